"""MLA's latent KV cache (absorbed decode) against the expanded cache and transformers, float32, on a tiny
DeepSeek-V3-shaped checkpoint: MLA with q_lora_rank, shared experts, sigmoid router with bias and groups."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 - the test extra installs it: missing fails, not skips
from _hf import HF_BASE, save_random_hf_model

import moerl.models as mm
from moerl.rollout import Engine, Request, SamplingParams
from moerl.rollout.kv_cache import kv_layout

R, ROPE, LAYERS = 8, 4, 3  # kv_lora_rank, qk_rope_head_dim, layers
DSV3 = dict(
    HF_BASE,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
    max_position_embeddings=128,
    num_hidden_layers=LAYERS,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    q_lora_rank=16,
    kv_lora_rank=R,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=8,
    v_head_dim=8,
    routed_scaling_factor=2.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
"""A DeepSeek-V3-shaped transformers config at toy size (4 heads, latent rank 8, 8 experts in 4 groups)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv3")
    hf = save_random_hf_model("deepseek_v3", folder, seed=5, attn_implementation="eager", **DSV3)
    return hf, mm.from_pretrained(folder)


def _prompts():
    gen = torch.Generator().manual_seed(7)
    pre = torch.randint(2, 64, (10,), generator=gen).tolist()  # a preamble shared by the first two
    return [pre + torch.randint(2, 64, (n,), generator=gen).tolist() for n in (3, 7)] + [
        torch.randint(2, 64, (n,), generator=gen).tolist() for n in (1, 5)
    ]


def _requests(n, max_new_tokens=16, **kw):
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=p,
            params=SamplingParams(max_new_tokens=max_new_tokens, n=n, seed=i, **kw),
        )
        for i, p in enumerate(_prompts())
    ]


def _assert_same(ref, out, routed=False):
    assert [(c.request_id, c.sample_index) for c in out] == [(c.request_id, c.sample_index) for c in ref]
    for a, b in zip(ref, out, strict=True):
        assert b.token_ids == a.token_ids, (a.request_id, a.sample_index)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        if routed:
            assert torch.equal(b.routed_experts, a.routed_experts), (a.request_id, a.sample_index)


def test_latent_cache_allocates_rank_plus_rope_per_token_and_layer(models):
    _, ours = models
    assert kv_layout(ours.config).latent and not kv_layout(ours.config, "expanded").latent
    per_token = (R + ROPE) * LAYERS * 4  # float32
    paged = Engine(ours, cache="paged", max_slots=4, kv_token_budget=64, block_size=4)
    tokens = (paged.cache.num_blocks + 1) * 4  # the blocks and the null block
    assert paged.cache.k.nbytes + paged.cache.v.nbytes == tokens * per_token
    slots = Engine(ours, max_slots=4, kv_token_budget=64)
    assert slots.cache.k.nbytes + slots.cache.v.nbytes == 4 * 16 * per_token
    expanded = Engine(
        ours, cache="paged", max_slots=4, kv_token_budget=64, block_size=4, mla_cache="expanded"
    )
    heads, dk, dv = 4, 8 + ROPE, 8
    assert expanded.cache.k.nbytes + expanded.cache.v.nbytes == tokens * heads * (dk + dv) * LAYERS * 4
    with pytest.raises(ValueError, match="mla_cache='compressed'"):
        Engine(ours, max_slots=4, kv_token_budget=64, mla_cache="compressed")


def test_greedy_latent_equals_expanded_and_transformers(models):
    hf, ours = models
    reqs = _requests(n=1, temperature=0.0)
    ref = Engine(
        ours, cache="paged", max_slots=8, kv_token_budget=1024, block_size=4, mla_cache="expanded"
    ).generate(reqs)
    for engine in (
        Engine(ours, cache="paged", max_slots=8, kv_token_budget=1024, block_size=4),
        Engine(ours, max_slots=3, kv_token_budget=3 * 40),  # the slot cache, one request joins late
    ):
        assert engine.cache.latent
        _assert_same(ref, engine.generate(reqs))
    for c in ref:  # transformers' logits of the whole sequence, one forward
        full = torch.tensor(c.prompt_ids + c.token_ids)[None]
        with torch.no_grad():
            lp = torch.log_softmax(hf(full).logits[0, len(c.prompt_ids) - 1 : -1].float(), -1)
        assert c.token_ids == lp.argmax(-1).tolist()
        want = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-5)


def test_sampled_groups_preemption_and_routed_experts_latent_equal_expanded(models):
    _, ours = models
    reqs = _requests(n=8, temperature=0.9, top_k=20, return_routed_experts=True)
    ref = Engine(
        ours, cache="paged", max_slots=32, kv_token_budget=4096, block_size=4, mla_cache="expanded"
    ).generate(reqs)
    roomy = Engine(ours, cache="paged", max_slots=32, kv_token_budget=4096, block_size=4)
    _assert_same(ref, roomy.generate(reqs), routed=True)
    assert roomy.stats.prefix_hit_tokens > 0 and roomy.stats.preemptions == 0
    tight = Engine(
        ours, cache="paged", max_slots=32, kv_token_budget=120, block_size=4
    )  # 30 blocks, 32 sequences
    _assert_same(ref, tight.generate(reqs), routed=True)
    assert tight.stats.preemptions > 0
