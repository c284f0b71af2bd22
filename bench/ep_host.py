"""Host work of one EP dispatch + combine round trip at world size 1, on the CPU (no device time).

    PYTHONPATH=<checkout> python bench/ep_host.py [--out-dir DIR]

The eager GPU round trip of ``bench/ep_smoke.py`` is host-bound where the device waits for the host: after
the dispatch's one device read (ids' range and copy count M) nothing is queued until the host has
finished the dispatch and launched the combine. This script measures that host work on a gloo group of
one rank with tiny CPU tensors (T = 64, H = 32, top-8 of 64), in two modes:

- ``glue``: the row kernels (``single_rank_layout``, ``gather_rows2``, ``gather_sum2``, as the flat
  dispatcher imports them) replaced by stand-ins that return precomputed outputs, so what is left is the
  dispatchers' own Python and the aten ops it issues: the host cost that is the same on a GPU, less the
  kernel launches themselves;
- ``full``: the real CPU tensor-op paths (their op counts are not the GPU's: there each is one kernel).

For each: microseconds per round trip (median of 7 repeats of 200 calls), split at the device read (the
first ``tolist`` of a 3-element tensor: the read of ``info``), and the aten ops before and after it
(``TorchDispatchMode``). Works on any checkout that has ``rows.single_rank_layout``, so the same script
gives the before/after figures. Writes ``<out-dir>/ep_host.json``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_json  # noqa: E402
from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology  # noqa: E402
from moerl.ep import alltoall as a2a_mod  # noqa: E402


class _Split:
    """Marks the read: the first ``tolist`` of a 3-element tensor in a round trip."""

    def __init__(self) -> None:
        self.t_read: float | None = None
        self._orig = torch.Tensor.tolist
        split = self

        def tolist(t):
            if split.t_read is None and t.dim() == 1 and t.numel() == 3:
                out = split._orig(t)
                split.t_read = time.perf_counter()
                return out
            return split._orig(t)

        self._patched = tolist

    def __enter__(self):
        torch.Tensor.tolist = self._patched
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._orig


class _CountOps(TorchDispatchMode):
    def __init__(self, split: _Split) -> None:
        super().__init__()
        self.split, self.before, self.after = split, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.before if self.split.t_read is None else self.after).append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _stub_kernels(x, idx, w, local_index, experts):
    """Replace the flat dispatcher's row kernels by stand-ins returning precomputed results."""
    saved = {n: getattr(a2a_mod, n) for n in ("single_rank_layout", "gather_rows2", "gather_sum2")}
    layout = saved["single_rank_layout"](idx, w, local_index, experts)
    rows = saved["gather_rows2"](x, x[:0], layout[1])
    summed = saved["gather_sum2"](rows, rows[:0], layout[2], w)
    a2a_mod.single_rank_layout = lambda *a, **k: layout
    a2a_mod.gather_rows2 = lambda *a, **k: rows
    a2a_mod.gather_sum2 = lambda *a, **k: summed
    return saved


def _measure(disp, x, idx, w, calls: int = 200, repeats: int = 7) -> dict:
    def roundtrip() -> None:
        recv_x, handle = disp.dispatch(x, idx, w)
        disp.combine(recv_x, handle)

    for _ in range(20):
        roundtrip()
    totals, pre, post = [], [], []
    with _Split() as split:
        for _ in range(repeats):
            tt = tp = 0.0
            for _ in range(calls):
                split.t_read = None
                t0 = time.perf_counter()
                roundtrip()
                t1 = time.perf_counter()
                tt += t1 - t0
                tp += (split.t_read or t0) - t0
            totals.append(1e6 * tt / calls)
            pre.append(1e6 * tp / calls)
            post.append(totals[-1] - pre[-1])
        split.t_read = None
        with _CountOps(split) as ops:
            roundtrip()
    return {
        "us_per_roundtrip": statistics.median(totals),
        "us_before_read": statistics.median(pre),
        "us_after_read": statistics.median(post),
        "aten_ops_before_read": len(ops.before),
        "aten_ops_after_read": len(ops.after),
        "ops_after_read": ops.after,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--calls", type=int, default=200, help="round trips per repeat")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    t, h, e, k = 64, 32, 64, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen)
    w, idx = torch.randn(t, e, generator=gen).softmax(-1).topk(k, dim=-1)
    results = {}
    try:
        for mode in ("glue", "full"):
            for cls in (AllToAllDispatcher, HierarchicalDispatcher):
                disp = cls(Topology(1, 1), e)
                saved = _stub_kernels(x, idx, w, torch.arange(e), e) if mode == "glue" else {}
                try:
                    results[f"{mode}/{cls.__name__}"] = _measure(disp, x, idx, w, a.calls, a.repeats)
                finally:
                    for n, f in saved.items():
                        setattr(a2a_mod, n, f)
    finally:
        dist.destroy_process_group()
    write_json("ep_host", {"benchmark": "ep_host", "label": a.label, "tokens": t, "hidden": h,
                           "experts": e, "top_k": k, "results": results}, a.out_dir)  # fmt: skip
    print(
        f"{'mode/dispatcher':36s} {'us/trip':>8s} {'pre-read':>9s} {'post-read':>9s} {'ops pre':>7s} {'ops post':>8s}"
    )
    for name, r in results.items():
        print(f"{name:36s} {r['us_per_roundtrip']:8.1f} {r['us_before_read']:9.1f} {r['us_after_read']:9.1f} "
              f"{r['aten_ops_before_read']:7d} {r['aten_ops_after_read']:8d}")  # fmt: skip
    for name, r in results.items():
        if name.startswith("glue"):
            print(f"{name} ops after the read: {r['ops_after_read']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
