"""The engine over the paged cache policy (paged KV cache, shared prefixes, preemption) against the slot Engine and transformers, float32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import Engine, InvalidRequestError, Request, SamplingParams
from moerl.rollout.block_pool import BlockPool, block_hashes
from moerl.rollout.weight_update import recompute_running

VOCAB = 61


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits, so greedy comparisons are meaningful
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m


PREAMBLE = 20  # tokens shared by the first three prompts (5 full blocks of 4)
SUFFIXES = (3, 9, 14)
ALONE = 5  # the fourth prompt shares nothing


def _prompts():
    gen = torch.Generator().manual_seed(1)
    pre = torch.randint(0, VOCAB, (PREAMBLE,), generator=gen).tolist()
    out = [pre + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in SUFFIXES]
    return out + [torch.randint(0, VOCAB, (ALONE,), generator=gen).tolist()]


def _requests(n=8, max_new_tokens=30, **kw):
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
        assert b.finish_reason == a.finish_reason
        if routed:
            assert torch.equal(b.routed_experts, a.routed_experts), (a.request_id, a.sample_index)


def test_block_pool_refcounts_free_list_and_hash_index():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(), pool.allocate()
    h = block_hashes([5, 6, 7, 8, 9], 2)
    assert len(h) == 2 and h == block_hashes([5, 6, 7, 8], 2) and h[1] != block_hashes([4, 6, 7, 8], 2)[1]
    pool.index(a, h[0], 0, (5, 6))
    assert pool.lookup(h[0], 0, (5, 6)) == a and pool.lookup(h[0], 0, (5, 7)) is None
    pool.share(a)
    pool.release(a)
    assert pool.num_free == 1 and pool.ref_count[a] == 1
    pool.release(a)
    assert pool.num_free == 2 and pool.lookup(h[0], 0, (5, 6)) == a  # freed, still indexed
    pool.share(a)  # a hit on a free block takes it back
    assert pool.num_free == 1
    c = pool.allocate()
    assert c not in (a, b) and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free block"):
        pool.allocate()
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == b  # least recently freed first; reallocating forgets a's hash next
    assert pool.allocate() == a and pool.lookup(h[0], 0, (5, 6)) is None


def test_groups_share_prompt_and_preamble_greedy_equal_slot_engine(model):
    reqs = _requests(temperature=0.0)
    ref = Engine(model, max_slots=32, kv_token_budget=32 * 80).generate(reqs)
    engine = Engine(model, cache="paged", max_slots=32, kv_token_budget=4000, block_size=4)
    _assert_same(ref, engine.generate(reqs))
    st = engine.stats
    # one prefill per group; the 2nd and 3rd prompts hit the preamble's 5 full blocks
    prompt_lens = [PREAMBLE + s for s in SUFFIXES] + [ALONE]
    assert st.prefill_tokens == sum(prompt_lens) - 2 * PREAMBLE
    assert st.prefix_hit_tokens == 7 * sum(prompt_lens) + 2 * PREAMBLE
    assert st.preemptions == 0 and st.blocks_used == 0 and st.running == 0
    assert st.decode_rows == 32 * 29 and st.mean_decode_batch == 32


def test_preemption_keeps_sampled_tokens_logprobs_and_routed_experts(model):
    reqs = _requests(temperature=0.8, top_k=20, return_routed_experts=True)
    ref = Engine(model, max_slots=32, kv_token_budget=32 * 80).generate(reqs)
    for budget in (300, 100):  # 75 and 25 blocks for 32 sequences of up to 64 tokens
        engine = Engine(model, cache="paged", max_slots=32, kv_token_budget=budget, block_size=4)
        _assert_same(ref, engine.generate(reqs), routed=True)
        assert engine.stats.preemptions > 0 and engine.stats.blocks_used == 0


def test_sync_every_and_buckets_with_preemption(model):
    reqs = _requests(temperature=1.0, max_new_tokens=20)
    ref = Engine(model, max_slots=32, kv_token_budget=32 * 80).generate(reqs)
    engine = Engine(
        model,
        cache="paged",
        max_slots=16,
        kv_token_budget=160,
        block_size=8,
        sync_every=4,
        batch_buckets=(4, 8, 16),
    )
    _assert_same(ref, engine.generate(reqs))
    assert engine.stats.preemptions > 0


def test_budget_far_below_slots_times_length_completes(model):
    # 16 sequences of up to 8 + 100 tokens; the cache holds 160 tokens (a tenth of 16 x 108)
    reqs = [
        Request(
            request_id=f"q{i}",
            prompt_ids=p[:8],
            params=SamplingParams(temperature=0.0, max_new_tokens=100, n=4),
        )
        for i, p in enumerate(_prompts())
    ]
    with pytest.raises(InvalidRequestError, match="longer than the context|can never fit"):
        Engine(model, max_slots=16, kv_token_budget=160).generate(reqs)
    ref = Engine(model, max_slots=16, kv_token_budget=16 * 120).generate(reqs)
    engine = Engine(model, cache="paged", max_slots=16, kv_token_budget=160, block_size=16)
    out = engine.generate(reqs)
    _assert_same(ref, out)
    assert all(len(c.token_ids) == 100 for c in out) and engine.stats.preemptions > 0
    with pytest.raises(InvalidRequestError, match="can never fit"):  # longer than the whole cache
        engine.generate(
            [Request(request_id="x", prompt_ids=[1] * 100, params=SamplingParams(max_new_tokens=61))]
        )


def test_recompute_after_weight_update_equals_fresh_prefill(model):
    import copy

    m = copy.deepcopy(model)
    reqs = _requests(temperature=0.0, n=2, max_new_tokens=12)
    engine = Engine(m, cache="paged", max_slots=8, kv_token_budget=4000, block_size=4)
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in m.named_parameters() if "norm" not in n}
    engine.update_weights(new, 1)
    recompute_running(engine)
    done = {}
    while engine.num_unfinished:
        done.update({(c.request_id, c.sample_index): c for c in engine.step()})
    # the reference: a slot engine given the same tokens before the update, recomputed the same way
    ref_model = copy.deepcopy(model)
    ref = Engine(ref_model, max_slots=8, kv_token_budget=8 * 64)
    for r in reqs:
        ref.add_request(r)
    for _ in range(4):
        ref.step()
    ref.update_weights(new, 1)
    recompute_running(ref)
    want = {}
    while ref.num_unfinished:
        want.update({(c.request_id, c.sample_index): c for c in ref.step()})
    _assert_same([want[k] for k in sorted(want)], [done[k] for k in sorted(done)])
    assert {tuple(c.policy_versions) for c in done.values()} != {(0,) * 12}
    assert engine.policy.pool.lookup(0, 0, ()) is None  # nothing indexed under stale weights is served


def test_greedy_equals_transformers_with_preemption(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from _hf import HF_BASE, save_random_hf_model

    import moerl.models as mm

    base = dict(HF_BASE, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    hf = save_random_hf_model(
        "qwen3_moe",
        tmp_path,
        seed=3,
        **base,
        intermediate_size=48,
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        norm_topk_prob=True,
    )
    ours = mm.from_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(4)
    pre = torch.randint(2, 64, (9,), generator=gen).tolist()
    prompts = [pre + torch.randint(2, 64, (n,), generator=gen).tolist() for n in (2, 5)] + [pre]
    new = 12
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            refs.append(
                hf.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
            )
    params = SamplingParams(temperature=0.0, max_new_tokens=new, n=3)
    engine = Engine(
        ours, cache="paged", max_slots=9, kv_token_budget=48, block_size=4
    )  # 12 blocks for 9 sequences
    outs = engine.generate(
        [Request(request_id=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
    )
    assert [c.token_ids for c in outs] == [r for r in refs for _ in range(3)]
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    for c in outs:  # greedy log-probs: log softmax of transformers' logits over prompt + response
        full = torch.tensor(c.prompt_ids + c.token_ids)[None]
        with torch.no_grad():
            lp = torch.log_softmax(hf(full).logits[0, len(c.prompt_ids) - 1 : -1].float(), -1)
        expected = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-5)
    # sampled (T = 0.8), preempting: log softmax(logits / T) of transformers' forward
    params = SamplingParams(temperature=0.8, max_new_tokens=new, n=3, seed=5)
    engine = Engine(ours, cache="paged", max_slots=9, kv_token_budget=48, block_size=4)
    outs = engine.generate(
        [Request(request_id=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
    )
    assert engine.stats.preemptions > 0
    for c in outs:
        full = torch.tensor(c.prompt_ids + c.token_ids)[None]
        with torch.no_grad():
            lp = torch.log_softmax(hf(full).logits[0, len(c.prompt_ids) - 1 : -1].float() / 0.8, -1)
        expected = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-5)


def test_preempted_sequences_stay_visible_in_flight(model):
    # 8 sequences of up to 8 + 40 tokens in 24 blocks of 4: some are preempted along the way
    reqs = [
        Request(
            request_id=f"s{i}",
            prompt_ids=p[:8],
            params=SamplingParams(temperature=0.0, max_new_tokens=40, n=2),
        )
        for i, p in enumerate(_prompts())
    ]
    engine = Engine(model, cache="paged", max_slots=8, kv_token_budget=96, block_size=4)
    for r in reqs:
        engine.add_request(r)
    seen_preempted = False
    while engine.num_unfinished:
        engine.step()
        preempted = {(s.request.request_id, s.sample_index) for s in engine.scheduler.preempted}
        in_flight = {
            (s.request.request_id, s.sample_index) for v in engine.running_by_request().values() for s in v
        }
        assert preempted <= in_flight and not preempted & {
            (s.request.request_id, s.sample_index) for s in engine.scheduler.running
        }
        seen_preempted |= bool(preempted)
        assert engine.policy.pool.num_used <= engine.policy.pool.num_blocks
    assert seen_preempted and engine.policy.pool.num_free == engine.policy.pool.num_blocks


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_graph_keys_padded_batch_and_rounded_read_length_decode_the_same(model, kind):
    """What a CUDA engine decodes under its graph keys (B padded to ``graph_batch_buckets``, R rounded by
    ``round_read_len``), here on CPU with a graph runner that runs each step eagerly: the same tokens and
    log-probs as exact shapes, with preemption in the paged engine."""
    from moerl.rollout.cuda_graphs import GraphRunner, graph_batch_buckets

    reqs = [  # lengths 10..40: the decode batch shrinks as requests finish
        Request(request_id=r.request_id, prompt_ids=r.prompt_ids, params=replace(r.params, max_new_tokens=n))
        for r, n in zip(_requests(temperature=1.0), (40, 10, 25, 17), strict=True)
    ]
    ref = Engine(model, max_slots=32, kv_token_budget=32 * 80).generate(reqs)
    if kind == "slots":
        engine = Engine(model, max_slots=32, kv_token_budget=32 * 80, attn_len_multiple=4)
    else:
        engine = Engine(
            model, cache="paged", max_slots=32, kv_token_budget=400, block_size=4, attn_len_multiple=4
        )
    engine._graphs = GraphRunner("cpu")  # a runner: the keyed path, each step run eagerly (CPU)
    engine.batch_buckets = graph_batch_buckets(engine.num_slots)
    seen: list[tuple[int, int]] = []
    run = engine._graphs.run
    engine._graphs.run = lambda key, fn: (seen.append(key[:2]), run(key, fn))[1]
    _assert_same(ref, engine.generate(reqs))
    assert {b for b, _ in seen} <= set(engine.batch_buckets) and len({b for b, _ in seen}) > 2
    assert len({r for _, r in seen}) < len(seen) / 4  # few read lengths recur over the steps
    if kind == "paged":
        assert engine.stats.preemptions > 0


def test_readmission_writes_back_the_saved_routed_experts(model):
    """A preempted R3 sequence's routed-experts records are saved on the host and written back when it is
    readmitted (not left to the readmission prefill): records replaced while it waits come out in its
    completion, past the prefix its readmission found in the cache."""
    reqs = _requests(n=2, max_new_tokens=12, temperature=1.0, return_routed_experts=True)
    engine = Engine(model, cache="paged", max_slots=8, kv_token_budget=64, block_size=4)
    for r in reqs:
        engine.add_request(r)
    marked, done = set(), []
    while engine.num_unfinished:
        for s in engine.scheduler.preempted:
            if s.saved_routed is not None and id(s) not in marked:
                s.saved_routed = torch.full_like(s.saved_routed, -7)
                marked.add(id(s))
        done += engine.step()
    assert marked and engine.stats.preemptions > 0
    assert any((c.routed_experts == -7).any() for c in done)
