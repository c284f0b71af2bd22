"""Per-rank body of the dispatchers' per-direction traffic test (imported by the fork server)."""

from __future__ import annotations

import torch

from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology

DISPATCHERS = {"alltoall": AllToAllDispatcher, "hierarchical": HierarchicalDispatcher}


def run_directions(rank: int, world: int, ranks_per_node: int) -> dict:
    """One dispatch -> expert op -> combine -> backward per dispatcher; the counters after each phase."""
    out = {}
    for name, cls in DISPATCHERS.items():
        disp = cls(Topology(world, ranks_per_node), 8)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(6, 16, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
        w = torch.rand(6, 2, generator=g).requires_grad_()
        recv, handle = disp.dispatch(x, idx, w)
        dispatched = disp.last_traffic
        y = disp.combine(recv * 2.0, handle)
        combined = disp.last_traffic
        forward = dict(disp.traffic_by_direction)
        y.square().sum().backward()
        links = disp._traffic_now()  # every link's counter: what the rank sent in all
        out[name] = {
            "dispatched": dispatched,
            "combined": combined,
            "forward": forward,
            "after": dict(disp.traffic_by_direction),
            "total": disp.total_traffic,
            "links": links,
        }
    return out
