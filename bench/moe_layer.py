"""MoE layer throughput: one Qwen3-MoE block (router + 64 experts, top-8) on N tokens, forward and
forward + backward, moerl against Hugging Face transformers on the same weights in the same process, and
against the bf16 matrix-product rate measured in the same process.

    python bench/moe_layer.py                                                  # CPU smoke (tiny)
    python bench/moe_layer.py --spec reference --tokens 16384 --device cuda    # the issue's H200 figure

Rows: ``transformers`` (its default experts implementation, named in the JSON), ``moerl-reference``
(``moerl.models.moe.Experts`` with the fast paths off) and ``moerl`` (the default path: on CUDA the
sync-free permutation and Triton combine of ``moerl.models.kernels``). FLOPs per token are
2 (H E + 3 k H I) forward and three times that forward + backward; TFLOP/s = FLOPs / median time, and
"of peak" divides by the measured matmul rate. The agreement rows compare outputs and gradients with a
float32 copy of the same block (same routing: moerl computes router logits in float32 either way).
Writes ``<out-dir>/moe_layer.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SPECS,
    bench_dtype,
    bench_parser,
    device_info,
    free_device_memory,
    measure_ceilings,
    peak_memory_gib,
    print_table,
    rel_err,
    same_weights_pair,
    time_fn,
    write_json,
)
from moerl.models.kernels import fast_paths  # noqa: E402


def _hf_call(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _moerl_call(block, x: torch.Tensor) -> torch.Tensor:
    return block(x[None])[0][0]


def _grads(block, call, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    y = call(block, x)
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


def check_agreement(ours, tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Outputs and gradients of the moerl block (fast paths on and off) against a float32 copy."""
    h = ours.router.weight.shape[1]
    gen = torch.Generator(device=device).manual_seed(123)
    x = torch.randn(tokens, h, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(tokens, h, generator=gen, device=device, dtype=dtype)
    ref32 = copy.deepcopy(ours).float()
    y32, g32 = _grads(ref32, _moerl_call, x.float(), dy.float())
    del ref32
    out = {}
    for name, enabled in (("moerl", True), ("moerl-reference", False)):
        with fast_paths(enabled):
            y, g = _grads(ours, _moerl_call, x, dy)
        out[name] = {"out": rel_err(y, y32), **{f"grad_{k}": rel_err(v, g32[k]) for k, v in g.items()}}
    for p in ours.parameters():
        p.grad = None
    return out


def bench_block(block, call, x: torch.Tensor, dy: torch.Tensor, device: torch.device, iters: int) -> dict:
    """Median times of forward (no grad) and forward + backward of ``block`` on ``x``."""
    params = list(block.parameters())

    def fwd() -> None:
        with torch.no_grad():
            call(block, x)

    def fwd_bwd() -> None:
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_(True)
        call(block, xg).backward(dy)

    warmup = 2 if device.type == "cuda" else 1
    t_f = time_fn(fwd, device, warmup=warmup, iters=iters)
    t_fb = time_fn(fwd_bwd, device, warmup=warmup, iters=iters)
    for p in params:
        p.grad = None
    return {"fwd": t_f.as_dict(), "fwd_bwd": t_fb.as_dict()}


def run(
    spec_name: str,
    tokens: int,
    device: torch.device,
    *,
    iters: int = 10,
    baseline: bool = True,
    out_dir: str | None = None,
    check_tokens: int = 2048,
) -> dict:
    """Build the same-weights pair, check agreement, time every implementation; returns the payload."""
    dtype = bench_dtype(device)
    spec = dataclasses.replace(SPECS[spec_name], num_layers=1)
    ceilings = measure_ceilings(device)
    hf, ours_model = same_weights_pair(spec, device, dtype)
    hf_block, ours = hf.model.layers[0].mlp, ours_model.layers[0].mlp
    agreement = check_agreement(ours, min(check_tokens, tokens), device, dtype)
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(tokens, spec.hidden_size, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(tokens, spec.hidden_size, generator=gen, device=device, dtype=dtype)
    with torch.no_grad():
        y_hf = _hf_call(hf_block, x)
        agreement["transformers_vs_moerl_out"] = rel_err(_moerl_call(ours, x), y_hf)
    results = {}
    free_device_memory(device)
    if baseline:
        results["transformers"] = bench_block(hf_block, _hf_call, x, dy, device, iters)
    with fast_paths(False):
        results["moerl-reference"] = bench_block(ours, _moerl_call, x, dy, device, iters)
    results["moerl"] = bench_block(ours, _moerl_call, x, dy, device, iters)
    flops_fwd = tokens * spec.moe_flops_per_token()
    for r in results.values():
        r["fwd"]["tflop_s"] = flops_fwd / (r["fwd"]["median_ms"] * 1e-3) / 1e12
        r["fwd_bwd"]["tflop_s"] = 3 * flops_fwd / (r["fwd_bwd"]["median_ms"] * 1e-3) / 1e12
        r["fwd_bwd"]["of_peak"] = r["fwd_bwd"]["tflop_s"] / ceilings.matmul_tflop_s
    if "transformers" in results:
        base = results["transformers"]
        for r in results.values():
            r["fwd_bwd"]["vs_transformers"] = base["fwd_bwd"]["median_ms"] / r["fwd_bwd"]["median_ms"]
            r["fwd"]["vs_transformers"] = base["fwd"]["median_ms"] / r["fwd"]["median_ms"]
    payload = {
        "benchmark": "moe_layer",
        **device_info(device),
        "spec": spec.as_dict(),
        "tokens": tokens,
        "dtype": str(dtype),
        "transformers_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "flops_fwd": flops_fwd,
        "ceilings": ceilings.as_dict(),
        "agreement_vs_float32": agreement,
        "peak_memory_gib": peak_memory_gib(device),
        "results": results,
    }
    write_json("moe_layer", payload, out_dir)
    _print(payload)
    return payload


def _print(p: dict) -> None:
    rows = []
    for name, r in p["results"].items():
        f, fb = r["fwd"], r["fwd_bwd"]
        rows.append(
            [
                name,
                f["median_ms"],
                f["tflop_s"],
                fb["median_ms"],
                fb["tflop_s"],
                fb["of_peak"],
                fb.get("vs_transformers"),
            ]
        )
    print_table(
        f"MoE layer, {p['tokens']} tokens, {p['spec']['name']} widths, {p['device']} "
        f"(matmul peak {p['ceilings']['matmul_tflop_s']:.0f} TFLOP/s)",
        ["impl", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s", "of peak", "x transformers"],
        rows,
    )
    a = p["agreement_vs_float32"]
    print(
        "agreement (rel. error vs float32 copy): "
        + ", ".join(
            f"{k}: out {v['out']:.2e} grad_x {v['grad_x']:.2e}" for k, v in a.items() if isinstance(v, dict)
        )
        + f"; transformers vs moerl out {a['transformers_vs_moerl_out']:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--no-baseline", dest="baseline", action="store_false", help="skip the transformers block"
    )
    run(**vars(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
