"""The planner's EP bytes and messages per link class equal the dispatchers' own Traffic counters.

Worlds of 4 ranks (4 x 1, 2 x 2, 1 x 4) and 6 ranks (3 x 2, 2 x 3) over gloo run AllToAllDispatcher and
HierarchicalDispatcher on seeded routing (uniform, group-limited with contiguous and round-robin placement,
empty slots, a rank without tokens); ``moerl.plan.traffic.exact_traffic`` gets the same routing.
"""

from __future__ import annotations

import plan_traffic_cases as cases
import pytest
import torch
from dist_harness import run_world

from moerl.ep import ExpertPlacement, Topology
from moerl.plan.traffic import RowBytes, exact_traffic

WORLDS = {4: [1, 2, 4], 6: [2, 3]}


@pytest.fixture(scope="module")
def measured() -> dict[int, list[dict]]:
    return {w: run_world(cases.run, w, gs, preload=("plan_traffic_cases",)) for w, gs in WORLDS.items()}


KEYS = [(w, g, c[0]) for w, gs in WORLDS.items() for g in gs for c in cases.CASES]


@pytest.mark.parametrize("world,g,name", KEYS, ids=str)
def test_planner_bytes_equal_dispatcher_counters(measured, world, g, name):
    case = next(c for c in cases.CASES if c[0] == name)
    _, e, k, _, _, kind, h, dtype, _ = case
    topo = Topology(world, g)
    rows = RowBytes(hidden=h * torch.empty(0, dtype=dtype).element_size(), top_k=k)
    planned = exact_traffic(cases.routing(case, world, g), ExpertPlacement(e, topo, kind), rows)
    moved = 0
    for rank, res in enumerate(measured[world]):
        for label in ("flat", "hier"):
            sent, back = res[(g, name, label)]
            assert planned[f"{label}_dispatch"][rank] == sent, f"rank {rank} {label} dispatch"
            assert planned[f"{label}_combine"][rank] == back, f"rank {rank} {label} combine"
            moved += sent.inter_node_bytes + sent.intra_node_bytes
    assert moved > 0  # the comparison is not between two empty counters
