"""Rollout engine throughput: generated tokens/s for a model config and batch size, on CPU or CUDA.

    python bench/rollout.py --config tiny --batch 16 --prompt-len 32 --new-tokens 32          # CPU smoke
    python bench/rollout.py --config reference --batch 256 --prompt-len 128 --new-tokens 128 \
        --device cuda --dtype bfloat16 --baseline                                              # H200

Every request samples exactly ``--new-tokens`` tokens (no stop tokens) from random prompts on a seeded
random model; the time covers prefill and decode of the whole batch (after one warm-up run).
``--baseline`` also runs Hugging Face transformers' ``generate`` on the same weights in the same process
and prints the ratio. Prints a table and writes ``bench/results/rollout.json`` (device, date, torch
version, config, figures), atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from moerl.config import ModelConfig
from moerl.models import build_model, save_pretrained
from moerl.rollout import Engine, Request, SamplingParams

CONFIGS = {
    "tiny": dict(vocab=256, model=ModelConfig(max_position_embeddings=1024)),
    # OLMoE-sized Qwen3-MoE of the one-GPU performance issue: ~6.9B parameters, 1.3B active per token.
    "reference": dict(
        vocab=50304,
        model=ModelConfig(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            num_experts=64,
            top_k=8,
            moe_intermediate_size=1024,
            max_position_embeddings=4096,
        ),
    ),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _requests(prompts: list[list[int]], args: argparse.Namespace, tag: str) -> list[Request]:
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=args.seed)
    return [Request(request_id=f"{tag}{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts)]


def bench_engine(model, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Time ``Engine.generate`` over the batch; returns seconds, generated tokens and tokens/s."""
    slots = args.max_slots or len(prompts)
    engine = Engine(
        model,
        max_slots=slots,
        kv_token_budget=slots * (args.prompt_len + args.new_tokens),
        sync_every=args.sync_every,
    )
    engine.generate(_requests(prompts[: min(4, len(prompts))], args, "warm"))
    _sync(args.device)
    t0 = time.perf_counter()
    outs = engine.generate(_requests(prompts, args, "r"))
    _sync(args.device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in outs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "num_slots": engine.num_slots,
    }


def bench_transformers(model, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The same batch through transformers' ``generate`` (same weights, loaded from a saved checkpoint)."""
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(model, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[args.dtype]).to(
            args.device
        )
    hf.eval()
    ids = torch.tensor(prompts, device=args.device)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
    kw.update(
        dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    )
    with torch.no_grad():
        hf.generate(ids[:4], **kw)
        _sync(args.device)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        _sync(args.device)
    seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def _write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--batch", type=int, default=16, help="requests (one sample each)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-slots", type=int, default=None, help="engine slots (default: the batch size)")
    p.add_argument("--sync-every", type=int, default=1, help="decode steps between host syncs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    p.add_argument(
        "--baseline", action="store_true", help="also run transformers' generate on the same weights"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout.json"))
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = CONFIGS[args.config]
    torch.manual_seed(args.seed)
    model_cfg = dataclasses.replace(spec["model"], device=str(args.device), dtype=args.dtype)
    with torch.device(args.device):  # initialize on the device: the reference model is 28 GB in float32
        model = build_model(model_cfg, spec["vocab"]).eval()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, spec["vocab"], (args.batch, args.prompt_len), generator=gen).tolist()

    results = {"moerl": bench_engine(model, prompts, args)}
    if args.baseline:
        results["transformers"] = bench_transformers(model, prompts, args)
        results["speedup"] = results["moerl"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]

    print(
        f"rollout  config={args.config} batch={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
        f"T={args.temperature} device={args.device} dtype={args.dtype}"
    )
    print(f"{'engine':<14}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for name in ("moerl", "transformers"):
        if name in results:
            r = results[name]
            print(f"{name:<14}{r['tokens']:>10}{r['seconds']:>10.3f}{r['tokens_per_s']:>12.1f}")
    if "speedup" in results:
        print(f"speedup (moerl / transformers): {results['speedup']:.2f}x")

    payload = {
        "benchmark": "rollout",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": {
            "name": args.config,
            "vocab_size": spec["vocab"],
            "model": dataclasses.asdict(model_cfg),
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "temperature": args.temperature,
            "dtype": args.dtype,
            "sync_every": args.sync_every,
        },
        "results": results,
    }
    _write_atomic(Path(args.out), payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
