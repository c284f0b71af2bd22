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


def prefix_kernel_errors() -> list[float]:
    """Max |kernel with shared-prefix groups - reference| over GQA, MHA and Dk != Dv: rows 0-2 share
    their first 3 blocks, rows 4-5 their first 2, rows 3 and 6 none; one split and several."""
    torch.manual_seed(1)
    errs = []
    for nh, nkv, dk, dv, bs, block_n in [(4, 2, 16, 16, 4, 16), (3, 3, 24, 20, 8, 16), (2, 1, 16, 8, 4, 32)]:
        nb, w, b = 60, 12, 7
        kc = torch.randn((nb + 1) * bs, nkv, dk)
        vc = torch.randn((nb + 1) * bs, nkv, dv)
        table = torch.stack([torch.randperm(nb)[:w] for _ in range(b)])
        table[1:3, :3] = table[0, :3]
        table[5, :2] = table[4, :2]
        lengths = torch.tensor([3 * bs + 1, w * bs, 3 * bs + 5, 9, 2 * bs + 2, 5 * bs, w * bs - 3])
        gr = pa.prefix_group_rows(nh // nkv)
        n = torch.zeros(b, dtype=torch.int32)
        plen = torch.zeros(b, dtype=torch.int64)
        rows = torch.zeros(b, gr, dtype=torch.int64)
        start = torch.zeros(b, dtype=torch.int64)
        for leader, members, blocks in ((0, [0, 1, 2], 3), (4, [4, 5], 2)):
            n[leader], plen[leader] = len(members), blocks * bs
            rows[leader, : len(members)] = torch.tensor(members)
            start[members] = blocks * bs
        # group slots: one empty (-1, reads and stores nothing), the leaders out of row order
        leaders = torch.tensor([4, -1, 0])
        groups = pa.PrefixGroups(leaders=leaders, n=n, length=plen, rows=rows, start=start)
        q = torch.randn(b, nh, dk)
        out = pa.paged_decode_attention(q, kc, vc, table, lengths, 0.3, bs, prefix=groups, block_n=block_n)
        ref = pa.paged_decode_reference(q, kc, vc, table, lengths, 0.3, bs)
        errs.append(float((out - ref).abs().max()))
    return errs


def _random_model(num_layers: int = 2):
    """A small Qwen3-MoE (vocabulary 61, context 64, ``num_layers`` layers) with seeded unit-scale weights
    outside the norms."""
    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3_moe", max_position_embeddings=64, num_layers=num_layers)
    model = build_model(cfg, 61)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


def _count_kernel_calls(calls: dict) -> None:
    """Route the paged cache's kernel launches through a counter: ``calls["n"]`` launches, ``calls["grouped"]``
    those that named a shared-prefix group (rows reading shared blocks once)."""
    import moerl.rollout.paged_kv_cache as pkv

    real = pa.paged_decode_attention

    def counted(*a, **k):
        calls["n"] = calls.get("n", 0) + 1
        prefix = k.get("prefix")
        calls["grouped"] = calls.get("grouped", 0) + (prefix is not None and int(prefix.n.sum()) > 0)
        return real(*a, **k)

    pkv.paged_decode_attention = counted


def _requests(prompts, tag: str, max_new_tokens: int, temperature: float) -> list:
    """Two samples of each prompt, request i seeded i."""
    return [
        Request(
            request_id=f"{tag}{i}",
            prompt_ids=p,
            params=SamplingParams(max_new_tokens=max_new_tokens, n=2, seed=i, temperature=temperature),
        )
        for i, p in enumerate(prompts)
    ]


def engine_check() -> dict:
    """The paged engine (kernel decode, block size 4, a budget forcing preemption) against the slot engine:
    greedy and sampled, tokens and log-probs; and how many kernel launches the paged run made."""
    model = _random_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (9, 3)]
    calls = {"n": 0, "grouped": 0}
    _count_kernel_calls(calls)
    result = {}
    for name, temp in (("greedy", 0.0), ("sampled", 0.9)):
        reqs = _requests(prompts, "r", 6, temp)
        ref = Engine(model, max_slots=4, kv_token_budget=4 * 32).generate(reqs)
        eng = Engine(model, cache="paged", max_slots=4, kv_token_budget=32, block_size=4)
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
    result["grouped_kernel_calls"] = calls["grouped"]
    return result


def group_slots_check() -> dict:
    """More groups running than the shared-prefix pass has slots (``prefix_max_groups``: 1 slot for up to 7
    rows): three prompts of two full blocks, two samples each, greedy, no preemption. The groups past the
    slots read their prompt themselves; tokens and log-probs must equal the slot engine's. Also counts the
    decode batches in which groups went unnamed."""
    model = _random_model()
    gen = torch.Generator().manual_seed(2)
    reqs = [
        Request(
            request_id=f"g{i}",
            prompt_ids=torch.randint(0, 61, (9 + i,), generator=gen).tolist(),
            params=SamplingParams(max_new_tokens=6, n=2, seed=i, temperature=0.0),
        )
        for i in range(3)
    ]
    ref = Engine(model, max_slots=8, kv_token_budget=8 * 32).generate(reqs)
    eng = Engine(model, cache="paged", max_slots=8, kv_token_budget=8 * 32, block_size=4)
    capped = {"batches": 0}
    real = eng.policy._prefix_groups

    def counted(batch_rows: int) -> None:
        real(batch_rows)
        firsts: dict[int, int] = {}
        for s in eng.scheduler.running:
            if len(s.blocks) > 1:
                firsts[s.blocks[0]] = firsts.get(s.blocks[0], 0) + 1
        groups = sum(c > 1 for c in firsts.values())
        named = int((eng.policy._prefix.n > 0).sum())
        capped["batches"] += groups > named >= 1

    eng.policy._prefix_groups = counted
    out = eng.generate(reqs)
    return {
        "tokens_equal": [c.token_ids for c in out] == [c.token_ids for c in ref],
        "max_logprob_diff": max(
            abs(x - y)
            for a, b in zip(ref, out, strict=True)
            for x, y in zip(a.logprobs, b.logprobs, strict=True)
        ),
        "capped_batches": capped["batches"],
    }


def verify_groups_check() -> dict:
    """Speculative verify through the kernel (n-gram drafts, k = 3, block size 4): each sequence's k + 1
    verify rows are one prefix group reading its cached blocks once (``PagedCachePolicy._verify_groups``).
    Greedy and sampled, against the same paged engine without speculation: tokens and log-probs equal;
    and how many verify launches named a group."""
    from moerl.config import RolloutConfig
    from moerl.rollout.sampler import token_logprobs
    from moerl.rollout.speculative import SpecPolicy

    # one layer: a verify's rows and prefix groups are the same in every layer, and each interpreted launch
    # costs seconds (two layers: 44 CPU-s of this check, about 40 % of the script; one: 24 CPU-s). Cache
    # layout across layers is checked against the slot engine above, at two layers
    model = _random_model(num_layers=1)
    prompts = [[5, 6, 7, 8, 9] * 3, [1, 2, 3] * 4 + [4]]  # repeats: the n-gram drafter finds drafts
    calls = {"n": 0, "grouped": 0}
    _count_kernel_calls(calls)
    result = {}
    for name, temp in (("greedy", 0.0), ("sampled", 0.9)):
        reqs = _requests(prompts, "v", 10, temp)
        out = {}
        # sampled: no run without speculation (its draws are not compared; each token's log-prob is checked
        # against a teacher-forced forward below): 4 sequences x 10 interpreted decode steps less
        for spec in ("off", "ngram") if temp == 0.0 else ("ngram",):
            cfg = RolloutConfig(max_slots=8, kv_token_budget=512, kv_block_size=4, speculative=spec)
            eng = Engine.from_config(model, cfg, cache="paged", seed=0)
            if eng.speculation is not None:  # speculate at every step (no acceptance or cost rule)
                eng.speculation.policy = SpecPolicy(min_acceptance=0.0, clock=lambda: 0.0)
            before = calls["grouped"]
            out[spec] = eng.generate(reqs)
            spec_steps = eng.stats.spec_steps if spec != "off" else 0
            grouped = calls["grouped"] - before
        ref, got = out.get("off"), out["ngram"]
        result[name] = {"spec_steps": spec_steps, "grouped_calls": grouped}
        if temp == 0.0:  # greedy: the same tokens and log-probs as without speculation
            result[name]["tokens_equal"] = [c.token_ids for c in got] == [c.token_ids for c in ref]
            result[name]["max_logprob_diff"] = max(
                abs(x - y)
                for a, b in zip(ref, got, strict=True)
                for x, y in zip(a.logprobs, b.logprobs, strict=True)
            )
        else:  # sampled: other draws, each token's log-prob the policy's (a teacher-forced forward)
            diffs = []
            for c in got:
                ids = torch.tensor([c.prompt_ids + c.token_ids])
                with torch.no_grad():
                    logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
                tf = token_logprobs(logits, torch.tensor(c.token_ids), temp)
                diffs += (tf - torch.tensor(c.logprobs)).abs().tolist()
            result[name]["tokens_equal"] = True  # not compared: sampling draws differ with speculation
            result[name]["max_logprob_diff"] = max(diffs)
    return result


print(
    json.dumps(
        {
            "kernel_errors": kernel_errors(),
            "prefix_kernel_errors": prefix_kernel_errors(),
            "engine": engine_check(),
            "group_slots": group_slots_check(),
            "verify_groups": verify_groups_check(),
        }
    )
)
