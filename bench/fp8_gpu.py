"""FP8 against bf16 rollout weights: decode tokens/s of moerl's ``Engine`` at B = 256 for a ~1 B MoE and a
DeepSeek-V3-shaped model scaled to fit one GPU (the real MLA and expert widths, fewer layers and
experts), against the bandwidth floor; and the FP8 GEMMs (dense and grouped experts) against the
reference dequantization.

    python bench/fp8_gpu.py --device cuda          # the H200 figures (both models, B = 256)
    python bench/fp8_gpu.py --tiny                 # CPU smoke in seconds (tiny shapes, fallback path)

Weights: ``rollout.weight_dtype=fp8`` as a run uses it (``moerl.rollout.weight_dtype``: the bf16 model's
projections and experts block-quantized, 128 x 128 float32 scales, activations bf16; the GEMMs are
``moerl.models.fp8_kernels.fp8_grouped_mm`` on CUDA with Triton, else dequantize-then-matmul, which the
table names as ``path``).

Decode rate: B random prompts of P tokens, each sampling N tokens at temperature 1 (no stop tokens);
decode tokens/s = B (N - 1) / (t_N - t_1), t_n the wall time of a whole batch generating n tokens (the
median of ``--runs`` runs after a warm-up run that also captures the CUDA graphs), so the prefill cancels.

Floor: a decode step reads the weights it uses (every matrix but the embedding; the experts the batch
touches, E (1 - (1 - k/E)^B) of each layer's E) and the cached keys/values of B x (P + N/2) tokens on
average; floor tokens/s = B / (bytes / BW), BW the copy bandwidth measured here (bytes read + written).
FP8 matrices count 1 byte per weight plus their scales.

Correctness: for one attention projection, one dense/shared MLP projection and one layer's routed experts
of each model, ||fast - ref|| / ||ref|| with ref = x.float() @ W.T, W = ``dequantize_blockwise`` (the
reference dequantization, float32), and the same for the bf16-dequantized fallback path.
Writes ``<out-dir>/fp8_gpu.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, measure_ceilings, print_table, rel_err, write_json  # noqa: E402
from moerl.models.config import MoeConfig  # noqa: E402
from moerl.models.fp8 import FP8_DTYPE, Fp8Experts, Fp8Linear, dequantize_blockwise  # noqa: E402
from moerl.models.fp8_kernels import fp8_mm_supported  # noqa: E402
from moerl.models.model import MoeForCausalLM  # noqa: E402
from moerl.models.moe import experts_forward  # noqa: E402
from moerl.rollout import Engine, Request, SamplingParams  # noqa: E402
from moerl.rollout.kv_cache import kv_layout  # noqa: E402
from moerl.rollout.weight_dtype import prepare_rollout_model  # noqa: E402


def _moe_1b(tiny: bool) -> dict:
    """A Qwen3-MoE of ~0.95 B parameters (12 layers, hidden 2048, 16 experts of 512, top-4, vocab 32k)."""
    if tiny:
        return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256,
                    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=256, norm_topk_prob=True)  # fmt: skip
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=32000,
                hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                head_dim=128, intermediate_size=4096, moe_intermediate_size=512, num_experts=16,
                num_experts_per_tok=4, max_position_embeddings=4096, norm_topk_prob=True)  # fmt: skip


def _deepseek_v3_scaled(tiny: bool) -> dict:
    """DeepSeek-V3's widths (hidden 7168, MLA q_lora 1536 / kv_lora 512, 128 heads of nope 128 + rope 64,
    v 128, experts of 2048, one shared expert, top-8 sigmoid routing in groups) with 3 layers (the first
    dense) and 32 routed experts: ~5.4 B parameters. ``tiny``: the same structure at CPU size."""
    if tiny:
        widths = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, num_hidden_layers=2, max_position_embeddings=256)  # fmt: skip
    else:
        widths = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                      num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32, num_experts_per_tok=8,
                      n_group=8, topk_group=4, num_hidden_layers=3, max_position_embeddings=4096)  # fmt: skip
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                num_key_value_heads=widths["num_attention_heads"], n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", **widths)  # fmt: skip


MODELS = {"moe_1b": _moe_1b, "deepseek_v3_scaled": _deepseek_v3_scaled}


def build(hf: dict, device: torch.device, dtype: torch.dtype) -> MoeForCausalLM:
    """A seeded model of the HF config ``hf`` on ``device`` in ``dtype`` (normal(0, 0.02) matrices)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = MoeForCausalLM(MoeConfig.from_hf_dict(hf))
    model.init_weights()
    return model.to(dtype).keep_router_buffers_fp32().eval()


def step_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` rows reads: every tensor but the embedding table, the
    routed experts scaled by the expected fraction a batch touches, E (1 - (1 - k/E)^B) / E."""
    cfg = model.config
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch
    total = 0.0
    for name, t in model.state_dict().items():
        if name.startswith("embed_tokens") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        nbytes = t.numel() * t.element_size()
        total += nbytes * (touched if ".experts." in name else 1.0)
    return total


def gemm_checks(model: torch.nn.Module, device: torch.device) -> list[dict]:
    """Relative error of the FP8 GEMMs against the reference dequantization (module docstring)."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    picks = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    picks = [picks[0], *[p for p in picks if "mlp" in p[0]][:1]]  # attention, and a dense/shared MLP if any
    experts = next((n, m) for n, m in model.named_modules() if isinstance(m, Fp8Experts))
    with torch.no_grad():
        for name, lin in picks:
            x = torch.randn(256, lin.in_features, device=device, generator=gen).to(torch.bfloat16)
            w = dequantize_blockwise(lin.weight, lin.weight_scale_inv)  # float32 reference
            ref = x.float() @ w.T
            fast = lin(x)
            fallback = x @ dequantize_blockwise(lin.weight, lin.weight_scale_inv, x.dtype).T
            rows.append({"tensor": name, "path": _path(x), "rel_err": rel_err(fast, ref),
                         "rel_err_dequant_bf16": rel_err(fallback, ref)})  # fmt: skip
        name, ex = experts
        h, e, k = ex.gate_up_proj.shape[2], ex.gate_up_proj.shape[0], model.config.num_experts_per_tok
        x = torch.randn(256, h, device=device, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, device=device, generator=gen)[:k] for _ in range(256)])
        wts = torch.rand(256, k, device=device, generator=gen)
        gu, dn = ex.dequantized(torch.float32)
        ref = experts_forward(x.float(), idx, wts, gu, dn, use_grouped_mm=False)
        fallback = experts_forward(x, idx, wts, *ex.dequantized(x.dtype))
        rows.append({"tensor": name, "path": _path(x), "rel_err": rel_err(ex(x, idx, wts), ref),
                     "rel_err_dequant_bf16": rel_err(fallback, ref)})  # fmt: skip
    return rows


def _path(x: torch.Tensor) -> str:
    return "triton fp8" if fp8_mm_supported(x) else "dequantize + matmul"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(model, args, device: torch.device) -> dict:
    """Decode tokens/s of an ``Engine`` over ``model`` (module docstring), and the peak memory."""
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    engine = Engine(model, max_slots=b, kv_token_budget=b * (p + n), sync_every=args.sync_every, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (p,), generator=gen).tolist() for _ in range(b)]

    def timed(new: int) -> float:
        params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
        reqs = [Request(request_id=f"r{i}", prompt_ids=q, params=params) for i, q in enumerate(prompts)]
        _sync(device)
        t0 = time.perf_counter()
        engine.generate(reqs)
        _sync(device)
        return time.perf_counter() - t0

    timed(n), timed(1)  # warm-up: CUDA graphs captured, kernels compiled
    t_n = statistics.median(timed(n) for _ in range(args.runs))
    t_1 = statistics.median(timed(1) for _ in range(args.runs))
    tps = b * (n - 1) / max(t_n - t_1, 1e-9)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"decode_tokens_per_s": tps, "t_n_s": t_n, "t_1_s": t_1, "peak_gib": mem}


def floor_rate(model, args, copy_tb_s: float | None, dtype: torch.dtype) -> dict:
    """Floor tokens/s of a decode step (module docstring) and its bytes."""
    b = args.batch
    kv = kv_layout(model.config).bytes_per_token(dtype) * b * (args.prompt_len + args.new_tokens / 2)
    step = step_weight_bytes(model, b) + kv
    floor = b / (step / (copy_tb_s * 1e12)) if copy_tb_s else None
    return {
        "step_weight_gb": step_weight_bytes(model, b) / 1e9,
        "step_kv_gb": kv / 1e9,
        "floor_tokens_per_s": floor,
    }


def run_model(key: str, args, device: torch.device, copy_tb_s: float | None) -> list[dict]:
    """bf16 and FP8 rows of one model: decode rate, floor, GEMM checks. The FP8 model is the bf16 one
    quantized in place (``rollout.weight_dtype=fp8``), so one copy is on the device at a time."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(MODELS[key](args.tiny), device, dtype)
    n_params = sum(t.numel() for t in model.state_dict().values())
    out = []
    for weights in ("bf16", "fp8"):
        if weights == "fp8":
            prepare_rollout_model(model, "fp8")
            assert any(t.dtype == FP8_DTYPE for t in model.state_dict().values())
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        row = {"model": key, "params_b": n_params / 1e9, "weights": weights, "batch": args.batch,
               **decode_rate(model, args, device), **floor_rate(model, args, copy_tb_s, dtype)}  # fmt: skip
        if row["floor_tokens_per_s"]:
            row["of_floor"] = row["decode_tokens_per_s"] / row["floor_tokens_per_s"]
        if weights == "fp8":
            row["gemm_checks"] = gemm_checks(model, device)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the script in seconds")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--out-dir", default=None, help="where fp8_gpu.json goes (default bench/results)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.device, args.batch, args.prompt_len, args.new_tokens, args.runs = torch.device("cpu"), 4, 8, 4, 1
    device = args.device
    copy_tb_s = measure_ceilings(device).copy_tb_s if device.type == "cuda" else None
    rows = [r for key in args.models for r in run_model(key, args, device, copy_tb_s)]
    print_table(
        f"decode at B={args.batch}, P={args.prompt_len}, N={args.new_tokens} (copy BW {copy_tb_s} TB/s)",
        ["model", "weights", "tok/s", "floor tok/s", "of floor", "weights GB/step", "KV GB/step", "peak GiB"],
        [[r["model"], r["weights"], r["decode_tokens_per_s"], r["floor_tokens_per_s"], r.get("of_floor"),
          r["step_weight_gb"], r["step_kv_gb"], r["peak_gib"]] for r in rows],
    )  # fmt: skip
    checks = [dict(c, model=r["model"]) for r in rows for c in r.get("gemm_checks", [])]
    print_table(
        "FP8 GEMM against the reference dequantization (rel. error, Frobenius)",
        ["model", "tensor", "path", "rel_err", "dequant->bf16 rel_err"],
        [[c["model"], c["tensor"], c["path"], c["rel_err"], c["rel_err_dequant_bf16"]] for c in checks],
    )
    for key in args.models:
        bf, f8 = (next(r for r in rows if r["model"] == key and r["weights"] == w) for w in ("bf16", "fp8"))
        print(
            f"{key}: fp8 / bf16 decode tokens/s = {f8['decode_tokens_per_s'] / bf['decode_tokens_per_s']:.2f}"
        )
    write_json("fp8_gpu", {"device": device_info(device), "args": {k: str(v) for k, v in vars(args).items()},
                           "copy_tb_s": copy_tb_s, "rows": rows}, args.out_dir)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
