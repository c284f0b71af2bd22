"""Single-GPU NCCL smoke of ``moerl.ep``'s dispatchers at EP world size 1 (multi-GPU machines are withheld,
so this is the part of the multi-GPU EP issue one GPU can run).

    python bench/ep_smoke.py --device cuda      # NCCL, one rank
    python bench/ep_smoke.py                    # gloo on CPU (smoke of the script itself)

For ``AllToAllDispatcher`` and ``HierarchicalDispatcher``: dispatch -> per-expert SwiGLU -> combine of
T tokens (hidden H, top-k of E experts, bfloat16 on CUDA) against the same experts run by
``moerl.models.kernels.fused_experts`` (relative error of outputs and of the input gradient), then the
median latency of dispatch + combine with identity experts, and the payload bytes the dispatch moves
(T k H element bytes: at world size 1 every copy stays on the rank, so this is a local-copy figure,
not an interconnect one). Writes ``<out-dir>/ep_smoke.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    TimeStats,
    device_info,
    init_one_rank_group,
    print_table,
    rel_err,
    time_fn,
    write_json,
)
from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology  # noqa: E402
from moerl.models.kernels import expert_order_no_sync, fused_experts, gather_sum_rows  # noqa: E402
from moerl.rollout.cuda_graphs import GraphRunner  # noqa: E402


def _ep_moe(disp, x, idx, w, gate_up, down):
    recv_x, handle = disp.dispatch(x, idx, w)
    counts = handle.tokens_per_local_expert
    offs = counts.cumsum(0).to(torch.int32)
    if x.is_cuda:
        gu = torch._grouped_mm(recv_x, gate_up.transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(g) * u).contiguous(), down.transpose(-2, -1), offs=offs)
    else:
        ys = []
        for e, xe in enumerate(recv_x.split(counts.tolist())):
            g, u = (xe @ gate_up[e].T).chunk(2, dim=-1)
            ys.append((F.silu(g) * u) @ down[e].T)
        y = torch.cat(ys)
    return disp.combine(y, handle).to(x.dtype)


def _interleaved_reps(
    results: dict, fns: dict, bare, bare_ms: float, device, payload_bytes: int, reps: int = 5
):
    """Time the bare pass and every dispatcher again, round-robin, ``reps`` times: one machine-state
    swing then moves all figures alike; each figure becomes the median of its 1 + reps medians."""
    times = {"_bare": [bare_ms], **{k: [v["dispatch_combine_ms"]] for k, v in results.items()}}
    for _ in range(reps):
        times["_bare"].append(time_fn(bare, device, warmup=2, iters=20).median_ms)
        for name, fn in fns.items():
            times[name].append(time_fn(fn, device, warmup=2, iters=20).median_ms)
    bare_med = statistics.median(times["_bare"])
    for name in fns:
        t = statistics.median(times[name])
        results[name].update(dispatch_combine_ms=t, dispatch_combine_ms_reps=times[name], vs_bare_permute=t / bare_med,
                             payload_gb_s=2 * payload_bytes / (t * 1e-3) / 1e9)  # fmt: skip
    return bare_med, times["_bare"]


def _graph_roundtrip(disp, x, idx, w, device: torch.device) -> dict:
    """Dispatch + combine captured in a CUDA graph (a group of one rank takes the fixed-capacity path
    during capture): replay against the eager result and the replay's median time. {} off CUDA or when
    the capture fails (the runner then stays eager, ``graph_captured`` False)."""
    if device.type != "cuda":
        return {}

    def fn() -> tuple[torch.Tensor]:
        recv_x, handle = disp.dispatch(x, idx, w)
        return (disp.combine(recv_x, handle),)

    with torch.no_grad():
        eager = fn()[0]
        runner = GraphRunner(device)
        runner.run("roundtrip", fn)
        out = runner.run("roundtrip", fn)[0]
        captured = runner.num_graphs == 1
        t = time_fn(lambda: runner.run("roundtrip", fn), device, warmup=2, iters=20)
    return {"graph_captured": captured, "graph_vs_eager": rel_err(out, eager), "graph_replay_ms": t.median_ms}


def run(
    device: torch.device, tokens: int, hidden: int, experts: int, top_k: int, inter: int, out_dir
) -> dict:
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    init_one_rank_group(device, 29533, backend, 60)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    w, idx = logits.softmax(-1).topk(top_k, dim=-1)
    gate_up = 0.02 * torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype)
    down = 0.02 * torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=dtype)
    xr = x.clone().requires_grad_(True)
    ref = fused_experts(xr, idx, w, gate_up, down)
    dy = torch.randn_like(ref)
    (gx_ref,) = torch.autograd.grad(ref, xr, dy)
    results = {}
    payload_bytes = tokens * top_k * hidden * x.element_size()

    def bare() -> None:  # the floor: permute + unpermute of the same rows, no dispatcher logic
        order, inverse, _ = expert_order_no_sync(idx, experts)
        rows = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
        gather_sum_rows(rows, inverse, w, top_k)

    t_bare = time_fn(bare, device, warmup=2, iters=20)
    fns = {}
    variants = [(AllToAllDispatcher, {}), (HierarchicalDispatcher, {})]
    if "fp8_dispatch" in AllToAllDispatcher.__init__.__code__.co_varnames:
        variants.insert(1, (AllToAllDispatcher, {"fp8_dispatch": True}))
    try:
        for cls, kw in variants:
            name = cls.__name__ + ("-fp8" if kw else "")
            disp = cls(Topology(1, 1), experts, **kw)
            xe = x.clone().requires_grad_(True)
            out = _ep_moe(disp, xe, idx, w, gate_up, down)
            (gx,) = torch.autograd.grad(out, xe, dy)

            def roundtrip(d=disp) -> None:
                recv_x, handle = d.dispatch(x, idx, w)
                d.combine(recv_x, handle)

            t = time_fn(roundtrip, device, warmup=2, iters=20)
            fns[name] = roundtrip
            graph = _graph_roundtrip(disp, x, idx, w, device)
            results[name] = {
                **graph,
                "out_rel_err": rel_err(out, ref),
                "grad_x_rel_err": rel_err(gx, gx_ref),
                "dispatch_combine_ms": t.median_ms,
                "vs_bare_permute": t.median_ms / t_bare.median_ms,
                "dispatch_payload_bytes": payload_bytes,
                "payload_gb_s": 2 * payload_bytes / (t.median_ms * 1e-3) / 1e9,
            }
        bare_ms, bare_reps = _interleaved_reps(results, fns, bare, t_bare.median_ms, device, payload_bytes)
    finally:
        dist.destroy_process_group()
    t_bare = TimeStats(bare_ms, t_bare.min_ms, t_bare.max_ms, t_bare.iters)
    payload = {
        "benchmark": "ep_smoke",
        **device_info(device),
        "backend": backend,
        "world_size": 1,
        "tokens": tokens,
        "hidden": hidden,
        "experts": experts,
        "top_k": top_k,
        "dtype": str(dtype),
        "bare_permute_unpermute_ms": t_bare.median_ms,
        "bare_permute_unpermute_ms_reps": bare_reps,
        "results": results,
    }
    write_json("ep_smoke", payload, out_dir)
    print_table(
        f"EP smoke, world size 1 ({backend}), T={tokens} H={hidden} top-{top_k} of {experts}",
        [
            "dispatcher",
            "out rel err",
            "grad rel err",
            "disp+comb ms",
            "x bare",
            "GB/s (2x payload)",
            "graph ms",
        ],
        [
            [
                "bare permute+unpermute",
                "-",
                "-",
                t_bare.median_ms,
                1.0,
                2 * payload_bytes / t_bare.median_ms / 1e6,
                "-",
            ]
        ]
        + [
            [
                k,
                v["out_rel_err"],
                v["grad_x_rel_err"],
                v["dispatch_combine_ms"],
                v["vs_bare_permute"],
                v["payload_gb_s"],
                v.get("graph_replay_ms", "-"),
            ]
            for k, v in results.items()
        ],
    )
    return payload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=None, help="default 4096 on CUDA, 64 on CPU")
    ap.add_argument("--hidden", type=int, default=None, help="default 4096 on CUDA, 32 on CPU")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=None, help="expert width; default 1024 on CUDA, 16 on CPU")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    big = dev.type == "cuda"
    run(
        dev,
        a.tokens or (4096 if big else 64),
        a.hidden or (4096 if big else 32),
        a.experts,
        a.top_k,
        a.inter or (1024 if big else 16),
        a.out_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
