"""MLA decode on one GPU: the latent KV cache (absorbed projections) vs the expanded cache, against the
bandwidth floor.

    python bench/mla_gpu.py --device cuda              # the H200 run: DeepSeek-V3's MLA and expert widths
    python bench/mla_gpu.py --tiny                     # CPU smoke run of the same code path (seconds)

Model: DeepSeek-V3's shapes (``moerl.plan.models.MODELS["deepseek-v3"]``: hidden 7168, 128 heads,
q_lora_rank 1536, kv_lora_rank 512, nope 128 + rope 64, v 128, experts of width 2048, top-8, one shared
expert, sigmoid group routing) with ``--layers`` layers (the first dense) and ``--experts`` routed
experts, so that it fits one GPU; random bf16 weights, a vocabulary of ``--vocab``.

One point = (cache form, B rows, C context tokens per row): a ``PagedKVCache`` holding B x C tokens in
blocks of ``--block-size`` (random contents: the figures are timings, not text), and the model's decode
forward of one token per row over it (CUDA events, median of ``--iters``; the forward is captured in a
CUDA graph on CUDA, as the engine replays it). A point whose cache does not fit the free memory is
reported as such (the expanded cache at B=256 and 4k tokens needs 1.3 TB for 4 layers).

Floor: bytes one decode step must read at the measured copy bandwidth (``measure_ceilings``): every
weight of the layers' attention, the dense and shared MLPs, the routed experts the B tokens touch (E (1 -
(1 - k/E)^B) per layer), the LM head, plus the cache: B x C x bytes per token (latent: (512 + 64) x 2
bytes per layer; expanded: 128 x (192 + 128) x 2). ``fraction of floor`` = floor time / measured time.

FP8 weights against bf16 on the same DeepSeek-V3 shapes: ``bench/fp8_gpu.py``.

Writes ``bench/results/mla_gpu.json`` atomically (``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import (
    device_info,
    free_device_memory,
    measure_ceilings,
    print_table,
    time_fn,
    write_json,
)
from moerl.models.config import MoeConfig, RopeScaling
from moerl.models.model import MoeForCausalLM
from moerl.plan.models import MODELS
from moerl.rollout.kv_cache import MLA_CACHE_FORMS, kv_layout
from moerl.rollout.paged_kv_cache import PagedKVCache


def model_config(layers: int, experts: int, vocab: int, tiny: bool) -> MoeConfig:
    """DeepSeek-V3's attention and expert shapes with ``layers`` layers (layer 0 dense) and ``experts``
    routed experts in 8 groups (top-4 groups; top-8 experts, fewer when ``experts`` < 8); ``tiny``
    divides every width by 32 (heads by 16) for the CPU smoke run."""
    s = MODELS["deepseek-v3"]
    d, h = (32, 16) if tiny else (1, 1)
    top_k = min(s.top_k, experts)
    groups = 8 if experts % 8 == 0 and experts >= 8 else 1
    return MoeConfig(
        model_type="deepseek_v3",
        vocab_size=vocab,
        hidden_size=s.hidden_size // d,
        num_hidden_layers=layers,
        num_attention_heads=s.num_heads // h,
        num_key_value_heads=s.num_heads // h,
        head_dim=s.qk_rope_dim // d if tiny else s.qk_rope_dim,
        intermediate_size=s.dense_intermediate_size // d,
        moe_intermediate_size=s.moe_intermediate_size // d,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        n_group=groups,
        topk_group=max(1, groups // 2),
        use_score_correction_bias=True,
        shared_intermediate_size=s.moe_intermediate_size // d,
        first_k_dense_replace=1 if layers > 1 else 0,
        q_lora_rank=s.q_lora_rank // d,
        kv_lora_rank=s.kv_lora_rank // d,
        qk_nope_head_dim=s.qk_nope_dim // d,
        qk_rope_head_dim=max(2, s.qk_rope_dim // d),
        v_head_dim=s.v_head_dim // d,
        rope_interleave=True,
        rope_scaling=RopeScaling(),
        max_position_embeddings=1 << 20,
    )


def step_weight_bytes(model: MoeForCausalLM, cfg: MoeConfig, rows: int, elem: int) -> float:
    """Bytes of weights one decode step of ``rows`` tokens reads: all but the routed experts and the
    embedding table (one row per token, ignored), plus the routed experts ``rows`` tokens touch under
    uniform routing, E (1 - (1 - k/E)^rows) per MoE layer."""
    routed = sum(b.experts.gate_up_proj.numel() + b.experts.down_proj.numel() for b in model.moe_blocks())
    embed = model.embed_tokens.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1.0 - (1.0 - k / e) ** rows) / e
    return ((total - routed - embed) + routed * touched) * elem


def _cache(cfg: MoeConfig, form: str, rows: int, context: int, block: int, dtype, device) -> PagedKVCache:
    """A paged cache of ``rows`` sequences of ``context`` tokens, random contents (torch.OutOfMemoryError
    when it cannot be allocated)."""
    blocks = rows * -(-context // block)
    cache = PagedKVCache(
        kv_layout(cfg, form), num_blocks=blocks, block_size=block, dtype=dtype, device=device
    )
    cache.k.normal_(0, 1)
    return cache


def decode_point(model, cfg: MoeConfig, form: str, rows: int, context: int, args, dtype, device) -> dict:
    """Time one decode step of ``rows`` rows at ``context`` cached tokens each with cache ``form`` (a
    dict of the timings, bytes and floor, or the reason it was skipped); the caller frees the memory."""
    point = {"cache": form, "batch": rows, "context": context}
    lay = kv_layout(cfg, form)
    elem = torch.empty((), dtype=dtype).element_size()
    point["cache_gib"] = rows * context * lay.bytes_per_token(dtype) / 2**30
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if free is not None and point["cache_gib"] * 2**30 > 0.85 * free:
        return {
            **point,
            "skipped": f"the cache needs {point['cache_gib']:.0f} GiB, {free / 2**30:.0f} GiB free",
        }
    try:
        cache = _cache(cfg, form, rows, context, args.block_size, dtype, device)
    except torch.OutOfMemoryError:
        free_device_memory(device)
        return {**point, "skipped": "out of memory allocating the cache"}
    width = -(-context // args.block_size)
    table = torch.arange(rows * width, device=device).view(rows, width)
    pos = torch.full((rows,), context - 1, dtype=torch.int64, device=device)
    ids = torch.randint(0, cfg.vocab_size, (rows, 1), device=device)

    def step():
        cache.bind_decode(table, pos)
        return model(ids, None, pos[:, None], cache=cache).logits

    fn = step
    if device.type == "cuda" and not args.no_graphs:
        step()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        fn = graph.replay
    try:
        t = time_fn(fn, device, warmup=2, iters=args.iters)
    except torch.OutOfMemoryError:
        return {**point, "skipped": "out of memory in the forward"}  # the caller frees the cache
    weights = step_weight_bytes(model, cfg, rows, elem)
    kv = rows * context * lay.bytes_per_token(dtype)
    floor_ms = (weights + kv) / (args.copy_tb_s * 1e12) * 1e3
    return {
        **point,
        "step_ms": t.median_ms,
        "tokens_per_s": rows / (t.median_ms * 1e-3),
        "weight_gb": weights / 1e9,
        "kv_gb": kv / 1e9,
        "floor_ms": floor_ms,
        "fraction_of_floor": floor_ms / t.median_ms,
    }


def run(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=torch.device, default=None, help="default: cuda if present, else cpu")
    ap.add_argument("--tiny", action="store_true", help="widths / 32, CPU, small batch and contexts: seconds")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--forms", nargs="+", choices=MLA_CACHE_FORMS, default=list(MLA_CACHE_FORMS))
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-graphs", action="store_true", help="eager forwards (no CUDA graph)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.device = args.device or torch.device("cpu")
        if args.batch == [256]:
            args.batch = [4]
        if args.contexts == [512, 4096, 16384]:
            args.contexts = [32, 128]
        args.vocab, args.iters, args.block_size = (
            min(args.vocab, 512),
            min(args.iters, 2),
            min(args.block_size, 16),
        )
        args.experts = min(args.experts, 8)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(args.layers, args.experts, args.vocab, args.tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = MoeForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ceil = measure_ceilings(device)
    args.copy_tb_s = ceil.copy_tb_s
    points = []
    with torch.no_grad():
        for context in args.contexts:
            for rows in args.batch:
                for form in args.forms:
                    points.append(decode_point(model, cfg, form, rows, context, args, dtype, device))
                    free_device_memory(device)  # the point's cache and CUDA graph are unreferenced now
    rows_out = [
        [
            p["cache"],
            p["batch"],
            p["context"],
            p["cache_gib"],
            p.get("step_ms"),
            p.get("tokens_per_s"),
            p.get("floor_ms"),
            p.get("fraction_of_floor"),
            p.get("skipped", ""),
        ]  # fmt: skip
        for p in points
    ]
    print_table(
        f"MLA decode, {cfg.num_hidden_layers} layers, {cfg.num_experts} experts, {device} "
        f"(copy {ceil.copy_tb_s:.2f} TB/s)",
        ["cache", "B", "context", "cache GiB", "step ms", "tok/s", "floor ms", "of floor", "note"],
        rows_out,
    )
    payload = {
        "device": device_info(device),
        "ceilings": ceil.as_dict(),
        "model": cfg.to_hf_dict(),
        "points": points,
    }
    path = write_json("mla_gpu" + ("_tiny" if args.tiny else ""), payload, args.out_dir)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    sys.exit(0 if run() else 1)
