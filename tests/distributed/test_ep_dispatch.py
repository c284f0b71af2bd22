"""EP dispatchers over gloo against the single-process MoE layer: 4 ranks (2 nodes x 2) and 8 ranks
(2 x 4 and 4 x 2). Each world is started once (module-scoped fixture) and runs every case; the
tests below assert on the per-rank results."""

from __future__ import annotations

import ep_cases
import pytest
from dist_harness import run_world

TOL = {"torch.float32": 1e-5, "torch.bfloat16": 3e-2}
WORLDS = {4: ([2], 8, 3), 8: ([4, 2], 16, 4)}  # world -> (ranks per node to test, experts, top-k)


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {
        world: run_world(ep_cases.run_cases, world, *args, preload=("ep_cases",))
        for world, args in WORLDS.items()
    }


CONFIGS = [(w, g) for w, (gs, _, _) in WORLDS.items() for g in gs]
KEYS = [
    (w, g, c.name, d, dt)
    for w, g in CONFIGS
    for c in ep_cases.CASES
    for d in ep_cases.DISPATCHERS
    for dt in TOL
]


@pytest.mark.parametrize("world,g,case,disp,dtype", KEYS, ids=lambda v: str(v))
def test_matches_single_process_layer(results, world, g, case, disp, dtype):
    """Forward output and gradients (inputs, router weights, experts) match the reference on every rank."""
    for rank, res in enumerate(results[world]):
        r = res[(g, case, disp, dtype)]
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL[dtype]}
        assert not bad, f"rank {rank}: relative errors above {TOL[dtype]}: {bad}"
        assert r["same_recv_as_alltoall"], f"rank {rank}: recv_x differs from the all-to-all baseline's"


@pytest.mark.parametrize("world,g,case,disp,dtype", KEYS, ids=lambda v: str(v))
def test_dispatch_bytes_match_hand_count(results, world, g, case, disp, dtype):
    """last_traffic of dispatch equals the (intra, inter) bytes counted by plain loops over the routing."""
    for rank, res in enumerate(results[world]):
        r = res[(g, case, disp, dtype)]
        t = r["traffic"]
        assert (t.intra_node_bytes, t.inter_node_bytes) == r["predicted"], f"rank {rank}"


@pytest.mark.parametrize("world,g", CONFIGS)
def test_fp8_dispatch(results, world, g):
    """fp8_dispatch: within e4m3 rounding of the bfloat16 run (output, every gradient) and sending
    H + 8 bytes per row instead of 2 H + 4."""
    for rank, res in enumerate(results[world]):
        r = res[(g, "fp8")]
        bad = {k: v for k, v in r["errors"].items() if not 0 < v < 8e-2}
        assert not bad, f"rank {rank}: FP8 vs bf16 relative errors outside (0, 8e-2): {bad}"
        assert r["bytes"] == r["expected_bytes"], f"rank {rank}"


@pytest.mark.parametrize("world,g", CONFIGS)
def test_zero_token_rank(results, world, g):
    """Rank 1 sends no token and receives none: it completes every collective, its output is [0, H]
    and its experts get gradients that exist and are exactly zero."""
    for disp in ep_cases.DISPATCHERS:
        for dtype in TOL:
            r = results[world][1][(g, "zero_rank", disp, dtype)]
            assert r["num_tokens"] == 0
            assert r["expert_grad_abs"] == 0.0
            other = results[world][0][(g, "zero_rank", disp, dtype)]
            assert other["expert_grad_abs"] > 0.0  # the check is not vacuous


@pytest.mark.parametrize("world,g", CONFIGS)
def test_deterministic_and_ordered(results, world, g):
    """Two runs are bitwise equal; received tokens are sorted by (local expert, source rank, token)."""
    for rank, res in enumerate(results[world]):
        assert res[(g, "deterministic")], f"rank {rank}"
        assert all(res[(g, "order")].values()), f"rank {rank}: {res[(g, 'order')]}"


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_bad_input_raises_on_every_rank(results, world):
    for rank, res in enumerate(results[world]):
        seen = res["bad_input"]
        assert f"invalid inputs on rank(s) [{world - 1}]" in seen["out_of_range"], seen
        if rank == world - 1:
            assert f"ids in [0, {WORLDS[world][1]}]" in seen["out_of_range"], seen
        assert "disagree on hidden size H" in seen["hidden_mismatch"] and "17" in seen["hidden_mismatch"], (
            seen
        )
        assert "not a multiple of ranks_per_node=3" in seen["topology"], seen
        assert seen["after"] == "True", "the group must still work after the errors"


def test_hierarchical_sends_fewer_inter_node_bytes(results):
    """With k = 4 experts spread over 2 nodes, each token crosses once per node instead of once per
    remote expert, so the hierarchical path sends fewer inter-node bytes in total."""
    for g in (4, 2):
        totals = {
            d: sum(res[(g, "random", d, "torch.bfloat16")]["traffic"].inter_node_bytes for res in results[8])
            for d in ep_cases.DISPATCHERS
        }
        assert totals["hierarchical"] < totals["alltoall"], totals
