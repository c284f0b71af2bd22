"""Issue 34: a 4-rank rollout EP group laid out as 2 nodes x 2 ranks (``rollout.ep_ranks_per_node=2``) over
gloo, float32, decodes as ep 1 does (tokens identical, log-probs within 1e-5) with the flat and the
hierarchical dispatcher, and the bytes each rank sends, inter-node and intra-node, equal ``moerl plan``'s
prediction for that layout (``moerl.plan.replay.replayed_traffic`` of the run's own routing)."""

from __future__ import annotations

import ep_engine_cases as base_cases
import ep_nodes_cases as cases
import pytest
from dist_harness import run_world

from moerl.ep import ExpertPlacement, Topology
from moerl.plan.replay import replayed_traffic
from moerl.plan.traffic import RowBytes

PHASE = {"alltoall": "flat", "hierarchical": "hier"}


@pytest.fixture(scope="module")
def two_nodes() -> list[dict]:
    return run_world(cases.run_two_nodes, 4, 2, preload=("ep_nodes_cases",), timeout_s=240)


def test_two_node_group_decodes_as_ep1(two_nodes):
    ref = {
        (c.request_id, c.sample_index): (c.token_ids, c.logprobs)
        for c in base_cases.new_engine(base_cases.make_model()).generate(base_cases.requests())
    }
    for disp in PHASE:
        got = {(rid, j): (t, lp) for res in two_nodes for rid, j, t, lp in res[disp]["completions"]}
        assert got.keys() == ref.keys(), disp
        for key, (tokens, logprobs) in got.items():
            assert tokens == ref[key][0], (disp, key)
            assert logprobs == pytest.approx(ref[key][1], abs=1e-5), (disp, key)


@pytest.mark.parametrize("disp", list(PHASE))
def test_inter_node_bytes_equal_the_plan(two_nodes, disp):
    model = base_cases.make_model()
    placement = ExpertPlacement(model.config.num_experts, Topology(4, 2))
    rows = RowBytes(
        hidden=model.config.hidden_size * 4, top_k=model.config.num_experts_per_tok
    )  # float32 rows
    planned = replayed_traffic([res[disp]["routing"] for res in two_nodes], placement, rows)
    inter = 0
    for rank, res in enumerate(two_nodes):
        measured = res[disp]["traffic"]
        assert measured["dispatch"] == planned[f"{PHASE[disp]}_dispatch"][rank], (disp, rank)
        assert measured["combine"] == planned[f"{PHASE[disp]}_combine"][rank], (disp, rank)
        inter += measured["dispatch"].inter_node_bytes + measured["combine"].inter_node_bytes
    assert inter > 0  # the group really crossed its node boundary
