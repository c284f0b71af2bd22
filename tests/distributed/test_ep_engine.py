"""EP rollout engine (moerl.rollout.ep_engine) over gloo, float32: greedy decoding at ep_size 2 and 4, flat
and hierarchical (2 simulated nodes), gives the ep_size=1 tokens and log-probs within 1e-5, also with a
rank that has no sequences and with a request admitted mid-run."""

from __future__ import annotations

import ep_engine_cases as cases
import pytest
from dist_harness import run_world


def _reference() -> dict:
    base = cases.make_model()
    ref = {}
    for c in cases.new_engine(base).generate(cases.requests()):
        ref[(c.request_id, c.sample_index)] = (c.token_ids, c.logprobs)
    late = cases.new_engine(base).generate([cases.late_request()])[0]
    ref[("late", 0)] = (late.token_ids, late.logprobs)
    return ref


@pytest.mark.parametrize("world,ranks_per_node", [(2, 1), (4, 2)])
def test_ep_engine_matches_ep1(world, ranks_per_node):
    ref = _reference()
    results = run_world(
        cases.run_engine_cases, world, ranks_per_node, preload=("ep_engine_cases",), timeout_s=240
    )
    for disp in ("alltoall", "hierarchical"):
        for case in ("all", "idle_last", "late"):
            got = {}
            for rank, res in enumerate(results):
                for rid, j, tokens, logprobs in res[f"{disp}/{case}"]:
                    got[(rid, j)] = (tokens, logprobs)
                if case == "idle_last" and rank == world - 1:
                    assert res[f"{disp}/{case}"] == []  # the idle rank ran no sequence, yet joined
                assert res[f"{disp}/experts"] == [4 // world] * 2  # experts are sharded
            want = {k: v for k, v in ref.items() if (k[0] == "late") == (case == "late") or case == "late"}
            assert got.keys() == want.keys(), (disp, case)
            for key, (tokens, logprobs) in got.items():
                assert tokens == ref[key][0], (disp, case, key)
                assert logprobs == pytest.approx(ref[key][1], abs=1e-5), (disp, case, key)


@pytest.mark.parametrize("world", [2, 4])
def test_paged_ep_engine_matches_slot_engine(world):
    """ep 2 and 4 (at 4 one rank has no group: it steps in lockstep idle), paged caches that preempt,
    sampled n=8 groups with a shared preamble and R3: the tokens, log-probs and routed experts of one slot
    engine on one rank."""
    ref = {}
    for c in cases.new_engine(cases.make_model()).generate(cases.paged_requests()):
        ref[(c.request_id, c.sample_index)] = (c.token_ids, c.logprobs, c.routed_experts.tolist())
    results = run_world(cases.run_paged_cases, world, 1, preload=("ep_engine_cases",), timeout_s=240)
    got = {}
    for res in results:
        assert res["prefix_hits"] > 0 or not res["completions"]
        for rid, j, tokens, logprobs, routed in res["completions"]:
            got[(rid, j)] = (tokens, logprobs, routed)
    assert sum(res["preemptions"] for res in results) > 0
    assert got.keys() == ref.keys()
    for key, (tokens, logprobs, routed) in got.items():
        assert tokens == ref[key][0], key
        assert logprobs == pytest.approx(ref[key][1], abs=1e-5), key
        assert routed == ref[key][2], key
