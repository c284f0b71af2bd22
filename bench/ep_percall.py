"""Per-call cost of ``moerl.ep``'s dispatchers at small token counts, EP world size 1 over NCCL (one GPU).

    python bench/ep_percall.py --device cuda [--tokens 16 64 256 1024] [--hidden 2048]

Dispatch + combine round trips of identity experts at the decode sizes of the EP model bench (hidden 2048,
top-8 of 64 experts, bf16), median of CUDA-event times after warm-up, and the same round trip timed by the
host clock around a device synchronize (what a decode step that waits for its tokens sees). A line
t = call_s + T * per_token_s fitted over the token counts gives the per-call fixed cost that
``moerl.plan`` adds to each MoE layer of an eager EP decode step. Uses the dispatchers' public API only,
so it runs against any checkout (``bench/results/perfplan/`` has this round's and the issue-10 code's).
Writes ``<out-dir>/ep_percall.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path.cwd()))

from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _events_ms(fn, iters: int) -> float:
    if not torch.cuda.is_available():  # CPU smoke: host clock
        return _host_ms(fn, iters)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def _host_ms(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--label", default="")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    try:
        for cls in (AllToAllDispatcher, HierarchicalDispatcher):
            disp = cls(Topology(1, 1), a.experts)
            for t in a.tokens:
                x = torch.randn(t, a.hidden, generator=gen, device=dev, dtype=dtype)
                w, idx = (
                    torch.randn(t, a.experts, generator=gen, device=dev).softmax(-1).topk(a.top_k, dim=-1)
                )

                def roundtrip(d=disp, x=x, idx=idx, w=w) -> None:
                    with torch.no_grad():
                        recv_x, handle = d.dispatch(x, idx, w)
                        d.combine(recv_x, handle)

                ev = _events_ms(roundtrip, a.iters)
                host = _host_ms(roundtrip, a.iters)
                rows.append({"dispatcher": cls.__name__, "tokens": t, "events_ms": ev, "host_sync_ms": host})
                print(f"{a.label} {cls.__name__:24s} T={t:6d} events {ev:.3f} ms, host+sync {host:.3f} ms")
    finally:
        dist.destroy_process_group()
    fits = {}
    for name in ("AllToAllDispatcher", "HierarchicalDispatcher"):
        pts = [r for r in rows if r["dispatcher"] == name]
        if len(pts) >= 2:
            xs = torch.tensor([float(r["tokens"]) for r in pts], dtype=torch.float64)
            for key in ("events_ms", "host_sync_ms"):
                ys = torch.tensor([r[key] for r in pts], dtype=torch.float64)
                design = torch.stack([torch.ones_like(xs), xs], 1)
                sol = torch.linalg.lstsq(design, ys[:, None]).solution[:, 0]
                fits[f"{name}/{key}"] = {"call_ms": float(sol[0]), "per_token_ms": float(sol[1])}
    payload = {
        "benchmark": "ep_percall",
        "label": a.label,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "backend": backend,
        "hidden": a.hidden,
        "experts": a.experts,
        "top_k": a.top_k,
        "dtype": str(dtype),
        "rows": rows,
        "fits": fits,
    }
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep_percall.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
