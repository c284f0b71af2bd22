"""Worker for test_plan_traffic: run both EP dispatchers on seeded routing and return their Traffic counters.

Every rank draws the same global routing from the case's seed (all ranks' topk_idx), so the parent process
can hand the very same routing to ``moerl.plan.traffic.exact_traffic`` and compare.
"""

from __future__ import annotations

import zlib

import torch

from moerl.ep import AllToAllDispatcher, ExpertPlacement, HierarchicalDispatcher, Topology
from moerl.plan.traffic import sample_group_limited_routing

# (name, experts, top-k, router groups, groups kept, placement, hidden, dtype, empty slots)
CASES = [
    ("uniform", 24, 3, 1, 1, "contiguous", 24, torch.bfloat16, False),
    ("grouped", 24, 4, 4, 2, "contiguous", 40, torch.float32, False),
    ("round_robin", 24, 4, 4, 2, "round_robin", 40, torch.bfloat16, True),
]


def tokens_of(rank: int) -> int:
    return 5 + 7 * rank if rank != 2 else 0  # unequal, and rank 2 has no tokens


def routing(case: tuple, world: int, ranks_per_node: int) -> list[torch.Tensor]:
    """Every rank's topk_idx [T_r, k] int64 (-1 = empty slot in the ``empty slots`` cases)."""
    name, e, k, groups, kept, _, _, _, holes = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}/{ranks_per_node}".encode()))
    out = []
    for r in range(world):
        idx = sample_group_limited_routing(tokens_of(r), e, k, groups, kept, gen)
        if holes and idx.numel():
            idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
        out.append(idx)
    return out


def run(rank: int, world: int, ranks_per_node_list: list[int]) -> dict:
    """{(G, case name, dispatcher): (dispatch Traffic, combine Traffic)} of this rank."""
    out = {}
    for g in ranks_per_node_list:
        topo = Topology(world, g)
        for case in CASES:
            name, e, k, _, _, kind, h, dtype, _ = case
            idx = routing(case, world, g)[rank]
            x = torch.randn(idx.shape[0], h).to(dtype)
            w = torch.rand(idx.shape[0], k)
            for label, cls in (("flat", AllToAllDispatcher), ("hier", HierarchicalDispatcher)):
                disp = cls(topo, e, placement=ExpertPlacement(e, topo, kind))
                recv, handle = disp.dispatch(x, idx, w)
                sent = disp.last_traffic
                disp.combine(recv, handle)
                out[(g, name, label)] = (sent, disp.last_traffic)
    return out
