"""Flat vs hierarchical EP dispatch over a shaped inter-node link: a 2-node rollout EP group in network
namespaces (issue 35's experiment; issue 34's rollout EP groups across nodes).

    node 0 = namespace A: EP ranks 0, 1        node 1 = namespace B: EP ranks 2, 3
    intra-node: loopback inside the namespace (tbf at 10 x the inter-node rate)
    inter-node: A's veth -- bridge -- B's veth (tbf at --rate-mbit each way, ``tests/multinode/netns.py``)

Both dispatchers run the same greedy decode job (``EPEngine``, gloo, float32, ``ranks_per_node=2``) on
the same 4 processes, one after the other. For each it records:
- rollout tokens/s (new tokens of all ranks / wall time of ``generate``, rank 0's clock between barriers; the
  median of ``--repeats`` runs, the dispatchers alternating);
- bytes over the inter-node link both ways, read from node 0's veth counters inside its namespace
  (``/sys/class/net/<veth>/statistics/{tx,rx}_bytes``, what ``ip -s link`` prints; Ethernet, IP and TCP
  headers, ACKs and the job's small control collectives included);
- moerl's own dispatcher counters (payload bytes per link class, ``EPEngine.ep_traffic``);
- ``moerl plan``'s predictions for that topology: exact (``moerl.plan.replay.replayed_traffic`` of the
  run's own routing, which equals the counters) and the planner's routing model
  (``moerl.plan.traffic.expected_traffic``, uniform top-k at the run's tokens per dispatch);
- decode agreement with ep 1 (one ``Engine`` in the driver): tokens identical, largest log-prob gap.

    python bench/multinode_dispatch.py                 # writes bench/results/multinode_dispatch_<date>.json
    python bench/multinode_dispatch.py --quick --out-dir /tmp/x   # small job (the CI test's)

Needs root, ``ip netns`` and ``tc`` (the harness's ``skip_reason`` says what is missing). On 2 shared CPU
cores compute and the shaped link both bound the step; the tokens/s ratio is the figure, not the value.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISPATCHERS = ("alltoall", "hierarchical")
WORLD, PER_NODE = 4, 2
HEADER_BYTES = 66
"""Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes per packet on the veth."""


def job(quick: bool) -> dict:
    """The model and the decode job (every rank and the ep-1 reference build the same from it)."""
    if quick:
        return dict(hidden=256, layers=2, experts=8, top_k=4, inter=32, vocab=97, prompts=4, prompt_len=6,
                    new_tokens=6, seed=0)  # fmt: skip
    return dict(hidden=1024, layers=2, experts=8, top_k=4, inter=32, vocab=97, prompts=8, prompt_len=8,
                new_tokens=24, seed=0)  # fmt: skip


def build_model(j: dict):
    """The float32 Qwen3-MoE of job ``j``, seeded; O(1) weights so that greedy logits are decisive."""
    import torch

    from moerl.config import ModelConfig
    from moerl.models import build_model as build

    torch.manual_seed(j["seed"])
    cfg = ModelConfig(hidden_size=j["hidden"], num_layers=j["layers"], num_heads=4, num_kv_heads=2,
                      head_dim=j["hidden"] // 4, num_experts=j["experts"], top_k=j["top_k"],
                      moe_intermediate_size=j["inter"], max_position_embeddings=256)  # fmt: skip
    m = build(cfg, j["vocab"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m.eval()


def requests(j: dict) -> list:
    """Greedy requests, ``prompts`` per rank (WORLD x prompts in all), request i on rank i % WORLD."""
    import torch

    from moerl.rollout import Request, SamplingParams

    g = torch.Generator().manual_seed(j["seed"] + 1)
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=torch.randint(0, j["vocab"], (j["prompt_len"],), generator=g).tolist(),
            params=SamplingParams(temperature=0.0, max_new_tokens=j["new_tokens"]),
        )
        for i in range(WORLD * j["prompts"])
    ]


def new_engine(model, j: dict):
    from moerl.rollout import Engine

    return Engine(copy.deepcopy(model), max_slots=j["prompts"], kv_token_budget=j["prompts"] * 64)


def _veth_bytes(dev: str) -> tuple[int, int, int, int]:
    """(tx bytes, rx bytes, tx packets, rx packets) of ``dev`` in this process's namespace."""
    base = Path(f"/sys/class/net/{dev}/statistics")
    return tuple(int((base / f).read_text()) for f in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"))


def rank_main(args) -> None:
    """One EP rank inside its node's namespace: both dispatchers' runs, results to ``<out>/rank<r>.pt``."""
    import torch
    import torch.distributed as dist

    from moerl.ep.traffic import RoutingLog
    from moerl.rollout.ep_engine import EPEngine

    torch.set_num_threads(1)
    j, rank = job(args.quick), args.rank
    dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    model = build_model(j)
    mine = [q for i, q in enumerate(requests(j)) if i % WORLD == rank]
    engines = {d: EPEngine(new_engine(model, j), dispatcher=d, ranks_per_node=PER_NODE) for d in DISPATCHERS}
    out = {d: {"wall_s": []} for d in DISPATCHERS}
    for ep in engines.values():
        ep.generate(mine[:1])  # warm-up (first forwards, the gloo pairs of the subgroups)
    for rep in range(args.repeats):  # alternating, so that the shared cores' load hits both alike
        for disp, ep in engines.items():
            before_ep = ep.ep_traffic
            log = RoutingLog(ep.dispatchers) if rep == 0 else None
            dist.barrier()
            link0 = _veth_bytes(args.veth) if rank == 0 else None
            dist.barrier()
            t0 = time.perf_counter()
            done = ep.generate(mine)
            dist.barrier()
            out[disp]["wall_s"].append(time.perf_counter() - t0)
            link1 = _veth_bytes(args.veth) if rank == 0 else None
            if rep:
                continue  # greedy: every repeat moves the same rows
            log.close()
            after = ep.ep_traffic
            out[disp].update(
                completions=[(c.request_id, c.token_ids, c.logprobs) for c in done],
                traffic={d: after[d] - before_ep[d] for d in after},
                routing=log.calls,
                link=None if link0 is None else tuple(b - a for a, b in zip(link0, link1, strict=True)),
            )
    dist.destroy_process_group()
    torch.save(out, Path(args.out) / f"rank{rank}.tmp")
    os.replace(Path(args.out) / f"rank{rank}.tmp", Path(args.out) / f"rank{rank}.pt")


def _netns():
    sys.path.insert(0, str(ROOT / "tests" / "multinode"))
    import netns  # the namespace harness (tests/multinode/netns.py)

    return netns


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_cluster(
    quick: bool, rate_mbit: float, scratch: Path, *, repeats: int = 1, timeout_s: float = 300.0
) -> list[dict]:
    """Build the 2-node cluster, shape its links, run the 4 ranks; their results in rank order.

    Raises:
        RuntimeError: a rank failed (its output in the message) or did not finish in ``timeout_s``.
    """
    import torch

    netns = _netns()
    with netns.Cluster(nodes=2) as c:
        fast = netns.LinkShape(rate_mbit=10 * rate_mbit)
        for i in range(2):
            c.shape(i, netns.LinkShape(rate_mbit=rate_mbit))  # the inter-node link, both ways
            for args in fast.tc_args():  # intra-node: the namespace's loopback, 10 x faster
                r = c.run(i, ["tc", "qdisc", "replace", "dev", "lo", *args])
                if r.returncode:
                    raise RuntimeError(f"tc on node {i}'s loopback failed: {r.stderr.strip()}")
        init = f"tcp://{c.node(0).addr}:{_free_port()}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = []
        for rank in range(WORLD):
            node = c.node(rank // PER_NODE)
            argv = [sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--init", init,
                    "--veth", node.node_if, "--out", str(scratch), "--repeats", str(repeats)] + (["--quick"] if quick else [])  # fmt: skip
            log = open(scratch / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append((c.popen(node.index, argv, env={**env, "GLOO_SOCKET_IFNAME": node.node_if},
                                  stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
        deadline = time.monotonic() + timeout_s
        for p, log in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            log.close()
        bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
        if bad:
            tails = "\n".join(f"rank {r}:\n{(scratch / f'rank{r}.log').read_text()[-3000:]}" for r in bad)
            raise RuntimeError(f"ranks {bad} failed or timed out:\n{tails}")
    return [torch.load(scratch / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def summarize(results: list[dict], quick: bool, rate_mbit: float) -> dict:
    """Per dispatcher: tokens/s, link bytes both ways, moerl's counters, the plan's predictions, agreement."""
    from moerl.ep import ExpertPlacement, Topology
    from moerl.plan.replay import replayed_traffic
    from moerl.plan.traffic import RowBytes, expected_traffic

    j = job(quick)
    model = build_model(j)
    ref = {c.request_id: (c.token_ids, c.logprobs) for c in new_engine(model, j).generate(requests(j))}
    placement = ExpertPlacement(j["experts"], Topology(WORLD, PER_NODE))
    rows = RowBytes(hidden=j["hidden"] * 4, top_k=j["top_k"])
    out = {}
    for disp, label in (("alltoall", "flat"), ("hierarchical", "hier")):
        runs = [r[disp] for r in results]
        got = {rid: (t, lp) for run in runs for rid, t, lp in run["completions"]}
        new_tokens = sum(len(t) for t, _ in got.values())
        gap = max(abs(a - b) for rid, (_, lp) in got.items() for a, b in zip(lp, ref[rid][1], strict=False))
        replay = replayed_traffic([run["routing"] for run in runs], placement, rows)
        planned = sum(
            replay[f"{label}_{d}"][r].inter_node_bytes for d in ("dispatch", "combine") for r in range(WORLD)
        )
        counted = sum(run["traffic"][d].inter_node_bytes for run in runs for d in ("dispatch", "combine"))
        intra = sum(run["traffic"][d].intra_node_bytes for run in runs for d in ("dispatch", "combine"))
        calls = list(zip(*[run["routing"] for run in runs], strict=True))
        model_pred = 0.0
        for call in calls:  # the planner's routing model (uniform top-k) at this call's tokens per rank
            tokens = sum(t.shape[0] for t in call) / WORLD
            if tokens:
                exp = expected_traffic(placement, tokens, rows)
                model_pred += WORLD * sum(
                    exp[f"{label}_{d}"].inter_node_bytes for d in ("dispatch", "combine")
                )
        tx, rx, tx_packets, rx_packets = runs[0]["link"]
        walls = sorted(runs[0]["wall_s"])
        wall = walls[len(walls) // 2]  # the median repeat
        out[disp] = {
            "tokens_identical_to_ep1": all(got[rid][0] == ref[rid][0] for rid in ref)
            and got.keys() == ref.keys(),
            "max_logprob_gap_vs_ep1": gap,
            "new_tokens": new_tokens,
            "wall_s": wall,
            "wall_s_repeats": runs[0]["wall_s"],
            "tokens_per_s": new_tokens / wall,
            "link_packets_both_ways": tx_packets + rx_packets,
            "link_header_bytes": HEADER_BYTES * (tx_packets + rx_packets),
            "link_bytes_node0_to_node1": tx,
            "link_bytes_node1_to_node0": rx,
            "link_bytes_both_ways": tx + rx,
            "moerl_inter_node_bytes": counted,
            "moerl_intra_node_bytes": intra,
            "plan_inter_node_bytes_exact": planned,
            "plan_inter_node_bytes_model": round(model_pred),
            "link_over_plan": (tx + rx) / planned if planned else None,
            "dispatch_calls": len(calls),
        }
    return {
        "rate_mbit_inter_node": rate_mbit,
        "rate_mbit_intra_node": 10 * rate_mbit,
        "job": j,
        "results": out,
    }


def table(summary: dict) -> str:
    """The README table (markdown) of one link rate."""
    r, rate = summary["results"], summary["rate_mbit_inter_node"]
    lines = [
        "| inter-node link | dispatcher | tokens/s (median; range) | veth bytes, both ways (packets) | "
        "moerl counters | plan: exact replay | plan: routing model | veth / plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for disp, x in r.items():
        n, walls = x["new_tokens"], x["wall_s_repeats"]
        lines.append(
            f"| {rate:g} Mbit/s | {disp} | {x['tokens_per_s']:.0f}; {n / max(walls):.0f}-{n / min(walls):.0f} | "
            f"{x['link_bytes_both_ways'] / 1e6:.2f} MB ({x['link_packets_both_ways']}) | "
            f"{x['moerl_inter_node_bytes'] / 1e6:.2f} MB | {x['plan_inter_node_bytes_exact'] / 1e6:.2f} MB | "
            f"{x['plan_inter_node_bytes_model'] / 1e6:.2f} MB | {x['link_over_plan']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small job of the CI test")
    p.add_argument("--rate-mbit", type=float, nargs="+", default=[200.0, 1000.0],
                   help="inter-node link rates to run, each way (Mbit/s); intra-node is 10 x each")  # fmt: skip
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each dispatcher (median reported)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--veth", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    reason = _netns().skip_reason()
    if reason:
        sys.exit(f"multinode_dispatch: {reason}")
    import tempfile

    runs = []
    for rate in args.rate_mbit:
        with tempfile.TemporaryDirectory() as scratch:
            results = run_cluster(args.quick, rate, Path(scratch), repeats=args.repeats)
        runs.append(summarize(results, args.quick, rate))
        print(table(runs[-1]), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out = Path(args.out_dir) / f"multinode_dispatch_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "date": stamp,
        "world": WORLD,
        "ranks_per_node": PER_NODE,
        "cpu_cores": os.cpu_count(),
        "runs": runs,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
