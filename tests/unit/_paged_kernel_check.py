"""Run under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) by tests/unit/test_paged_attention.py: the
paged decode kernel against its tensor-op definition, and the paged engine decoding through the kernel
against the slot engine. Prints one JSON line."""

from __future__ import annotations

import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from moerl.config import ModelConfig  # noqa: E402
from moerl.models import build_model  # noqa: E402
from moerl.rollout import Engine, Request, SamplingParams  # noqa: E402
from moerl.rollout import paged_attention as pa  # noqa: E402
from moerl.rollout.paged_engine import PagedEngine  # noqa: E402


def kernel_errors() -> list[float]:
    """Max |kernel - reference| over GQA, MHA and MLA-like (Dk != Dv) shapes, one split and several."""
    torch.manual_seed(0)
    errs = []
    for nh, nkv, dk, dv, bs, w, block_n in [
        (4, 2, 16, 16, 16, 8, 16),
        (6, 2, 24, 20, 4, 30, 16),
        (3, 3, 40, 8, 16, 2, 32),
    ]:
        nb = 40
        kc = torch.randn((nb + 1) * bs, nkv, dk)
        vc = torch.randn((nb + 1) * bs, nkv, dv)
        b = 5
        table = torch.stack([torch.randperm(nb)[:w] for _ in range(b)])
        lengths = torch.tensor([1, w * bs, 7, 0, w * bs // 2 + 3])
        q = torch.randn(b, nh, dk)
        out = pa.paged_decode_attention(q, kc, vc, table, lengths, 0.3, bs, block_n=block_n)
        ref = pa.paged_decode_reference(q, kc, vc, table, lengths, 0.3, bs)
        errs.append(float((out - ref).abs().max()))
    return errs


def engine_check() -> dict:
    """The paged engine (kernel decode, block size 4, a budget forcing preemption) against the slot engine:
    greedy and sampled, tokens and log-probs; and how many kernel launches the paged run made."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=64), 61)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (9, 3)]
    calls = {"n": 0}
    real = pa.paged_decode_attention

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    import moerl.rollout.paged_kv_cache as pkv

    pkv.paged_decode_attention = counted
    result = {}
    for name, temp in (("greedy", 0.0), ("sampled", 0.9)):
        reqs = [
            Request(
                request_id=f"r{i}",
                prompt_ids=p,
                params=SamplingParams(max_new_tokens=8, n=2, seed=i, temperature=temp),
            )
            for i, p in enumerate(prompts)
        ]
        ref = Engine(model, max_slots=4, kv_token_budget=4 * 32).generate(reqs)
        eng = PagedEngine(model, max_slots=4, kv_token_budget=32, block_size=4)
        out = eng.generate(reqs)
        result[name] = {
            "tokens_equal": [c.token_ids for c in out] == [c.token_ids for c in ref],
            "max_logprob_diff": max(
                abs(x - y)
                for a, b in zip(ref, out, strict=True)
                for x, y in zip(a.logprobs, b.logprobs, strict=True)
            ),
            "preemptions": eng.stats.preemptions,
        }
    result["kernel_calls"] = calls["n"]
    return result


print(json.dumps({"kernel_errors": kernel_errors(), "engine": engine_check()}))
