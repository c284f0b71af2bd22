"""Inter-node traffic of the EP dispatchers for a DeepSeek-V3-like layer, plus a small gloo timing.

Part 1 (analytic, exact): hidden 7168, 256 routed experts, top-8, 8 nodes x 8 ranks, node-limited to
M = 4 nodes, 4096 tokens per rank, bfloat16, routing drawn uniformly under the node limit. For every
one of the 64 simulated ranks it lays out the routing with ``moerl.ep.layout.compute_layout`` (the
code the dispatchers run) and counts the bytes each dispatcher sends per link class with
``send_traffic``: the flat all-to-all sends one row per (token, expert) slot, the hierarchical path
one row per (token, destination node) across nodes and then one per (token, destination rank)
inside the node. Rows carry their metadata as the dispatchers pack them (all-to-all: hidden + one
float32 weight; hierarchical: hidden + k int32 ids + k float32 weights).

Part 2 (informational): times dispatch + combine (forward) of both dispatchers on gloo with 4 local
processes as 2 nodes x 2 at a small size. CPU timings say nothing about GPU interconnects.

    python bench/ep_traffic.py            # prints the table, writes bench/results/ep_traffic.json
    python bench/ep_traffic.py --no-timing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moerl.ep import ExpertPlacement, Topology, compute_layout, sample_node_limited_routing
from moerl.ep.layout import Traffic, copies_per_rank, rows_in_ranks, send_traffic


@dataclass(frozen=True)
class LayerShape:
    hidden: int = 7168
    num_experts: int = 256
    top_k: int = 8
    num_nodes: int = 8
    ranks_per_node: int = 8
    max_nodes: int = 4
    tokens_per_rank: int = 4096
    bytes_per_elem: int = 2  # bfloat16
    seed: int = 0


def per_rank_traffic(s: LayerShape) -> dict[str, list[Traffic]]:
    """Dispatch and combine traffic sent by each rank, for both dispatchers."""
    topo = Topology(s.num_nodes * s.ranks_per_node, s.ranks_per_node)
    placement = ExpertPlacement(s.num_experts, topo)
    gen = torch.Generator().manual_seed(s.seed)
    r, g, k, h = topo.world_size, topo.ranks_per_node, s.top_k, s.hidden * s.bytes_per_elem
    layouts = [
        compute_layout(
            sample_node_limited_routing(s.tokens_per_rank, k, s.max_nodes, placement, gen), placement
        )
        for _ in range(r)
    ]
    flat_row, hier_row = h + 4, h + 8 * k
    copies = torch.stack([copies_per_rank(lay, r) for lay in layouts])  # [src, dst]
    per_node = torch.stack([lay.tokens_per_node for lay in layouts])  # [src, node]
    out: dict[str, list[Traffic]] = {
        name: [] for name in ("alltoall_dispatch", "alltoall_combine", "hier_dispatch", "hier_combine")
    }
    # Stage 2: forwarder (node, li) forwards its rail's tokens that need its node; fwd[li][node] holds
    # the number of those rows each rank of the node needs, [G].
    fwd = [
        [
            rows_in_ranks(
                torch.cat(
                    [
                        layouts[src].topk_rank[layouts[src].is_token_in_node[:, n]]
                        for src in topo.rail_ranks(li)
                    ]
                ),
                g,
                first_rank=n * g,
            )
            .sum(0)
            .tolist()
            for n in range(topo.num_nodes)
        ]
        for li in range(g)
    ]
    for me in range(r):
        node, li = topo.node_of(me), topo.local_index(me)
        out["alltoall_dispatch"].append(send_traffic(topo, me, list(range(r)), copies[me].tolist(), flat_row))
        out["alltoall_combine"].append(send_traffic(topo, me, list(range(r)), copies[:, me].tolist(), h))
        rail = topo.rail_ranks(li)
        stage1 = send_traffic(topo, me, rail, per_node[me].tolist(), hier_row)
        stage2 = send_traffic(topo, me, topo.node_ranks(node), fwd[li][node], hier_row)
        out["hier_dispatch"].append(stage1 + stage2)
        # Combine: partials back to the forwarders (intra), then node partials back to the sources (inter).
        back2 = send_traffic(topo, me, topo.node_ranks(node), [fwd[gf][node][li] for gf in range(g)], h)
        back1 = send_traffic(topo, me, rail, per_node[rail, node].tolist(), h)
        out["hier_combine"].append(back1 + back2)
    return out


def summarize(traffic: dict[str, list[Traffic]]) -> dict[str, dict[str, float]]:
    summary = {}
    for name, per_rank in traffic.items():
        inter = [t.inter_node_bytes for t in per_rank]
        intra = [t.intra_node_bytes for t in per_rank]
        summary[name] = {
            "inter_node_MB_mean": statistics.mean(inter) / 1e6,
            "inter_node_MB_max": max(inter) / 1e6,
            "intra_node_MB_mean": statistics.mean(intra) / 1e6,
            "inter_node_messages_mean": statistics.mean(t.inter_node_messages for t in per_rank),
        }
    return summary


def _timing_worker(rank: int, world: int, folder: str, shape: dict) -> None:
    import torch.distributed as dist

    from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    topo = Topology(world, shape["ranks_per_node"])
    placement = ExpertPlacement(shape["num_experts"], topo)
    gen = torch.Generator().manual_seed(rank)
    idx = sample_node_limited_routing(shape["tokens"], shape["top_k"], shape["max_nodes"], placement, gen)
    x = torch.randn(shape["tokens"], shape["hidden"], generator=gen).to(torch.bfloat16)
    w = torch.rand(shape["tokens"], shape["top_k"], generator=gen)
    times = {}
    for name, cls in (("alltoall", AllToAllDispatcher), ("hierarchical", HierarchicalDispatcher)):
        disp = cls(topo, shape["num_experts"])
        samples = []
        for it in range(shape["iters"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            recv_x, handle = disp.dispatch(x, idx, w)
            disp.combine(recv_x, handle)
            if it:  # the first iteration is a warm-up
                samples.append(time.perf_counter() - t0)
        times[name] = 1e3 * statistics.median(samples)
    if rank == 0:
        Path(folder, "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def gloo_timing(shape: dict) -> dict[str, float]:
    """Median ms of one dispatch + combine on rank 0 (4 processes as 2 nodes x 2)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _timing_worker, args=(shape["world"], folder, shape), nprocs=shape["world"], start_method="spawn"
        )
        return json.loads(Path(folder, "times.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-timing", action="store_true", help="skip the gloo timing")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ep_traffic.json"))
    args = parser.parse_args()
    shape = LayerShape()
    t0 = time.time()
    summary = summarize(per_rank_traffic(shape))
    ratio = (
        summary["hier_dispatch"]["inter_node_MB_mean"] / summary["alltoall_dispatch"]["inter_node_MB_mean"]
    )
    print(f"DeepSeek-V3-like layer ({shape}); layout of 64 ranks in {time.time() - t0:.1f} s\n")
    print(
        f"{'per rank':<20}{'inter-node MB (mean)':>22}{'inter-node MB (max)':>22}{'intra-node MB':>16}{'inter msgs':>12}"
    )
    for name, row in summary.items():
        print(
            f"{name:<20}{row['inter_node_MB_mean']:>22.1f}{row['inter_node_MB_max']:>22.1f}"
            f"{row['intra_node_MB_mean']:>16.1f}{row['inter_node_messages_mean']:>12.1f}"
        )
    ok = ratio <= 0.5
    print(f"\nhierarchical / all-to-all inter-node dispatch bytes = {ratio:.3f} ({'<=' if ok else '>'} 0.5)")
    timing_shape = {
        "world": 4,
        "ranks_per_node": 2,
        "tokens": 1024,
        "hidden": 1024,
        "num_experts": 16,
        "top_k": 4,
        "max_nodes": 2,
        "iters": 5,
    }
    timing = None if args.no_timing else gloo_timing(timing_shape)
    if timing:
        print(
            f"gloo, 4 CPU processes as 2 nodes x 2, {timing_shape}: dispatch+combine median ms "
            f"(informational) {timing}"
        )
    record = {
        "shape": asdict(shape),
        "per_rank": summary,
        "inter_node_dispatch_ratio": ratio,
        "hierarchical_at_most_half": ok,
        "gloo_timing_shape": timing_shape,
        "gloo_timing_ms": timing,
        "torch": torch.__version__,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
