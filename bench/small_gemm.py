"""Decode-size grouped GEMM: ``moerl.models.kernels.small_grouped_mm`` (Triton, weight streaming) against
``torch._grouped_mm`` on the reference MoE shapes (E = 64 experts, H = 2048, I = 1024, top-8), for a few
block configurations; correctness against ``torch._grouped_mm`` on fresh random inputs, median times,
and the weight bytes over time against the measured copy bandwidth.

    python bench/small_gemm.py --device cuda

Writes ``<out-dir>/small_gemm.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, measure_ceilings, print_table, rel_err, write_json  # noqa: E402
from moerl.models import kernels  # noqa: E402

CONFIGS = [
    {"block_m": 64, "block_n": 64, "block_k": 128, "stages": 4, "warps": 4},  # the first default
    {"block_m": 64, "block_n": 128, "block_k": 64, "stages": 4, "warps": 4},
    {"block_m": 32, "block_n": 64, "block_k": 128, "stages": 4, "warps": 4},
    {"block_m": 64, "block_n": 64, "block_k": 64, "stages": 5, "warps": 4},
    {"block_m": 64, "block_n": 32, "block_k": 128, "stages": 4, "warps": 2},
]


def loop_ms(fn, reps: int = 3, calls: int = 20) -> float:
    """Median over ``reps`` of the mean time of ``calls`` back-to-back calls between two CUDA events
    (the device queue runs ahead, so Python's launch time stays out of the figure, as in a CUDA graph)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def run(device: torch.device, out_dir: str | None) -> dict:
    ceil = measure_ceilings(device)
    e, h, i, k = 64, 2048, 1024, 8
    rows = []
    for tokens in (128, 256, 512):
        m = tokens * k
        idx = torch.rand(tokens, e, device=device).topk(k, dim=-1).indices
        _, _, offs = kernels.expert_order_no_sync(idx, e)
        for name, n, kk in (("gate_up", 2 * i, h), ("down", h, i)):
            w = (0.02 * torch.randn(e, n, kk, device=device)).to(torch.bfloat16)
            x = torch.randn(m, kk, device=device).to(torch.bfloat16)
            ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            wbytes = w.numel() * 2
            ms = loop_ms(lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=o))
            rows.append(
                {
                    "tokens": tokens,
                    "gemm": name,
                    "impl": "torch._grouped_mm",
                    "ms": ms,
                    "of_copy_bw": wbytes / (ms * 1e-3) / (ceil.copy_tb_s * 1e12),
                    "err": 0.0,
                }
            )
            for cfg in CONFIGS:
                try:
                    out = kernels.small_grouped_mm(x, w, offs, **cfg)
                    ms = loop_ms(lambda x=x, w=w, c=cfg, o=offs: kernels.small_grouped_mm(x, w, o, **c))
                except Exception as err:  # a configuration that does not compile: reported, not fatal
                    rows.append(
                        {
                            "tokens": tokens,
                            "gemm": name,
                            "impl": str(cfg),
                            "ms": None,
                            "error": repr(err)[:200],
                        }
                    )
                    continue
                rows.append(
                    {
                        "tokens": tokens,
                        "gemm": name,
                        "impl": str(cfg),
                        "ms": ms,
                        "of_copy_bw": wbytes / (ms * 1e-3) / (ceil.copy_tb_s * 1e12),
                        "err": rel_err(out, ref),
                    }
                )
    payload = {"benchmark": "small_gemm", **device_info(device), "ceilings": ceil.as_dict(), "rows": rows}
    write_json("small_gemm", payload, out_dir)
    print_table(
        "decode grouped GEMM (E=64, reference widths)",
        ["tokens", "gemm", "impl", "ms", "of copy bw", "rel err"],
        [
            [
                r["tokens"],
                r["gemm"],
                r["impl"],
                r.get("ms") or "-",
                r.get("of_copy_bw", "-"),
                r.get("err", r.get("error")),
            ]
            for r in rows
        ],
    )
    return payload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    run(torch.device(a.device), a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
