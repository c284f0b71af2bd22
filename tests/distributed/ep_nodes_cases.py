"""Per-rank body of the 2-node rollout EP group test: ``EPEngine`` on 2 (simulated) nodes x 2 ranks, its
routing logged for the planner (imported by the fork server; see dist_harness)."""

from __future__ import annotations

import ep_engine_cases as base_cases
import torch.distributed as dist

from moerl.ep.traffic import RoutingLog
from moerl.rollout.ep_engine import EPEngine


def run_two_nodes(rank: int, world: int, ranks_per_node: int) -> dict:
    """For each dispatcher: this rank's completions, its dispatcher's sent bytes by direction, and the
    ``topk_idx`` of every dispatch (the planner replays them)."""
    model = base_cases.make_model()
    out = {}
    for disp in ("alltoall", "hierarchical"):
        ep = EPEngine(base_cases.new_engine(model), dispatcher=disp, ranks_per_node=ranks_per_node)
        log = RoutingLog(ep.dispatchers)
        mine = [q for i, q in enumerate(base_cases.requests()) if i % world == rank]
        done = ep.generate(mine)
        log.close()
        out[disp] = {
            "completions": [(c.request_id, c.sample_index, c.token_ids, c.logprobs) for c in done],
            "traffic": ep.ep_traffic,
            "routing": log.calls,
        }
    dist.barrier()
    return out
