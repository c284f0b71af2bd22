"""Topology, expert placement, node-limited routing, layout, traffic accounting and comm helpers of
moerl.ep, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from moerl.ep import (
    ExpertPlacement,
    Topology,
    Traffic,
    compute_layout,
    node_limited_topk,
    sample_node_limited_routing,
)
from moerl.ep.comm import gather_slots, gather_sum, inverse_positions, pack_rows, unpack_rows
from moerl.ep.layout import check_topk_idx, copies_per_rank, rows_in_ranks, send_traffic


def test_topology_maps_ranks_to_nodes():
    t = Topology(8, 4)
    assert t.num_nodes == 2
    assert [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.local_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.node_ranks(1) == [4, 5, 6, 7]
    assert t.rail_ranks(2) == [2, 6]
    assert t.is_same_node(5, 7) and not t.is_same_node(3, 4)


@pytest.mark.parametrize("args,match", [((6, 4), "not a multiple"), ((0, 1), ">= 1"), ((4, 0), ">= 1")])
def test_topology_rejects_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        Topology(*args)


def test_topology_rejects_bad_rank():
    with pytest.raises(ValueError, match="outside"):
        Topology(4, 2).node_of(4)


def test_placements():
    topo = Topology(4, 2)
    c = ExpertPlacement(8, topo)
    assert c.expert_rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert c.expert_local_index.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert c.expert_node.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    rr = ExpertPlacement(8, topo, "round_robin")
    assert rr.expert_rank.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rr.local_experts(1).tolist() == [1, 5]
    assert c.num_local_experts == 2
    with pytest.raises(ValueError, match="multiple of the EP world size"):
        ExpertPlacement(6, topo)
    with pytest.raises(ValueError, match="unknown expert placement"):
        ExpertPlacement(8, topo, "random")


def test_node_limited_topk_hand_example():
    # 2 nodes x 1 rank, 4 experts: node 0 owns {0, 1}, node 1 owns {2, 3}; k = 2, M = 1.
    placement = ExpertPlacement(4, Topology(2, 1))
    scores = torch.tensor(
        [
            [0.9, 0.0, 0.8, 0.7],  # node sums of best k/M=2: 0.9 vs 1.5 -> node 1
            [0.5, 0.4, 0.6, 0.1],
        ]
    )  # 0.9 vs 0.7 -> node 0 (though expert 2 is best)
    idx = node_limited_topk(scores, 2, 1, placement)
    assert sorted(idx[0].tolist()) == [2, 3]
    assert sorted(idx[1].tolist()) == [0, 1]
    with pytest.raises(ValueError, match="max_nodes"):
        node_limited_topk(scores, 2, 3, placement)


def test_sampled_routing_respects_node_limit():
    placement = ExpertPlacement(32, Topology(8, 2))  # 4 nodes of 8 experts
    idx = sample_node_limited_routing(2000, 6, 2, placement, torch.Generator().manual_seed(0))
    nodes = placement.expert_node[idx]
    assert all(len(set(row)) <= 2 for row in nodes.tolist())
    assert all(len(set(row)) == 6 for row in idx.tolist())  # distinct experts
    share = torch.bincount(idx.flatten(), minlength=32).float() / idx.numel()
    assert (share - 1 / 32).abs().max() < 0.01  # uniform over experts by symmetry


def test_compute_layout_hand_example():
    placement = ExpertPlacement(8, Topology(4, 2))  # rank r owns experts 2r, 2r+1; ranks 0,1 on node 0
    idx = torch.tensor([[0, 5, -1], [1, 0, 3], [-1, -1, -1], [7, 6, 4]])
    lay = compute_layout(idx, placement)
    assert lay.topk_rank.tolist() == [[0, 2, -1], [0, 0, 1], [-1, -1, -1], [3, 3, 2]]
    assert lay.topk_local.tolist() == [[0, 1, -1], [1, 0, 1], [-1, -1, -1], [1, 0, 0]]
    assert lay.is_token_in_rank.tolist() == [
        [True, False, True, False],
        [True, True, False, False],
        [False] * 4,
        [False, False, True, True],
    ]
    assert lay.is_token_in_node.tolist() == [[True, True], [True, False], [False, False], [False, True]]
    assert lay.tokens_per_rank.tolist() == [2, 1, 2, 1]
    assert lay.tokens_per_node.tolist() == [2, 2]
    assert lay.tokens_per_expert.tolist() == [2, 1, 0, 1, 1, 1, 1, 1]
    assert copies_per_rank(lay, 4).tolist() == [3, 1, 2, 2]


def test_rows_in_ranks_window():
    ranks = torch.tensor([[4, 5, -1], [1, 6, 6]])
    assert rows_in_ranks(ranks, 2, first_rank=4).tolist() == [[True, True], [False, False]]


def test_check_topk_idx_messages():
    x = (3, 8)
    ok = torch.zeros(3, 2, dtype=torch.int64)
    w = torch.ones(3, 2)
    assert check_topk_idx(x, ok, w, 4) is None
    assert "int64" in check_topk_idx(x, ok.int(), w, 4)
    assert "ids in [-2, 0]" in check_topk_idx(x, torch.tensor([[-2, 0]] * 3), w, 4)
    assert "ids in [0, 4]" in check_topk_idx(x, torch.tensor([[4, 0]] * 3), w, 4)
    assert "topk_weights shape" in check_topk_idx(x, ok, torch.ones(3, 3), 4)
    assert "[T=3, k]" in check_topk_idx(x, torch.zeros(2, 2, dtype=torch.int64), w, 4)
    assert "x must be [T, H]" in check_topk_idx((3,), ok, w, 4)


def test_send_traffic_classifies_links():
    topo = Topology(4, 2)
    t = send_traffic(topo, 1, [0, 1, 2, 3], [5, 7, 0, 2], 10)
    assert t == Traffic(
        intra_node_bytes=50, inter_node_bytes=20, intra_node_messages=1, inter_node_messages=1
    )
    assert (t + t - t) == t
    assert t.as_metrics("ep/")["ep/inter_node_bytes"] == 20.0


def test_pack_unpack_roundtrip_mixed_dtypes():
    x = torch.randn(5, 3).to(torch.bfloat16)
    i = torch.arange(10, dtype=torch.int32).view(5, 2)
    w = torch.rand(5)
    buf = pack_rows(x, i, w)
    assert buf.dtype == torch.uint8 and buf.shape == (5, 3 * 2 + 2 * 4 + 4)
    x2, i2, w2 = unpack_rows(buf, [(torch.bfloat16, (3,)), (torch.int32, (2,)), (torch.float32, ())])
    assert torch.equal(x, x2) and torch.equal(i, i2) and torch.equal(w, w2)
    empty = pack_rows(torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.int32))
    assert empty.shape == (0, 20)


def test_gather_sum_and_positions():
    buf = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    pos = torch.tensor([[0, 2], [3, 1], [3, 3]])  # 3 = the zero row
    assert gather_sum(buf, pos).tolist() == [[101.0, 202.0], [10.0, 20.0], [0.0, 0.0]]
    assert gather_slots(torch.tensor([5.0, 6.0, 7.0]), pos).tolist() == [[5.0, 7.0], [0.0, 6.0], [0.0, 0.0]]
    # entries at flat slots 4 and 1 of a [3, 2] grid
    assert inverse_positions(torch.tensor([4, 1]), 3, 2).tolist() == [[2, 1], [2, 2], [0, 2]]
