"""The contract every KV-cache policy of the engine passes (``moerl.rollout.cache_policy.CachePolicy``).

A new policy joins ``POLICIES`` (its name in ``engine.CACHE_POLICIES``, or its class) with the engine
sizes that make it tight, and must pass every test here (docs/extending.md, "Cache policy"):
allocation stays within its bounds, finishing or cancelling frees everything, a group's samples share
one prefill of their prompt, running short of cache (eviction/preemption, or waiting) never changes a
token, and what the engine generates over it equals a teacher-forced forward of the model. Float32, CPU.
"""

from __future__ import annotations

import pytest
import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import CACHE_POLICIES, CachePolicy, Engine, InvalidRequestError, Request, SamplingParams
from moerl.rollout.slot_policy import SlotCachePolicy
from moerl.rollout.weight_update import cancel_all

VOCAB = 61

POLICIES = {
    # name: (the engine's cache argument, its own settings, a KV budget too small for the workload at once)
    "slots": ("slots", {"max_seq_len": 36}, 2 * 36),
    "paged": ("paged", {"block_size": 4}, 40),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits, so token comparisons are meaningful
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m


def engine(model, kind: str, *, tight: bool = False, **kw) -> Engine:
    cache, own, tight_budget = POLICIES[kind]
    return Engine(
        model, cache=cache, max_slots=8, kv_token_budget=tight_budget if tight else 8 * 48, **own, **kw
    )


def requests(n=2, max_new_tokens=12, **params) -> list[Request]:
    """Four prompts, the first three sharing a 12-token preamble; ``n`` samples each."""
    gen = torch.Generator().manual_seed(1)
    pre = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    prompts = [pre + torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in (3, 6, 9)]
    prompts.append(torch.randint(0, VOCAB, (5,), generator=gen).tolist())
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=p,
            params=SamplingParams(max_new_tokens=max_new_tokens, n=n, seed=i, **params),
        )
        for i, p in enumerate(prompts)
    ]


def outputs(completions) -> list[tuple]:
    return [(c.request_id, c.sample_index, c.token_ids, c.finish_reason) for c in completions]


@pytest.mark.parametrize("kind", POLICIES)
def test_the_policy_implements_the_protocol_and_is_chosen_by_the_caller(model, kind):
    eng = engine(model, kind)
    assert isinstance(eng.policy, CachePolicy) and eng.cache_kind == kind
    assert eng.cache is eng.policy.kv and eng.scheduler is eng.policy.scheduler
    assert all(t.shape[0] == eng.num_slots for t in eng.policy.row_state)
    if isinstance(POLICIES[kind][0], str):
        assert CACHE_POLICIES[kind] is type(eng.policy)


@pytest.mark.parametrize("kind", POLICIES)
def test_allocation_stays_within_the_policy_bounds(model, kind):
    """Every step: at most ``num_slots`` rows run, as rows 0..A-1, no sequence past ``max_seq_len``, no
    more cache units used than exist; a request longer than ``max_seq_len`` is refused at once."""
    eng = engine(model, kind, tight=True)
    with pytest.raises(InvalidRequestError):
        eng.add_request(
            Request(
                request_id="long", prompt_ids=[1] * 8, params=SamplingParams(max_new_tokens=eng.max_seq_len)
            )
        )
    assert eng.num_unfinished == 0
    for r in requests(temperature=1.0):
        eng.add_request(r)
    peak = 0
    while eng.num_unfinished:
        eng.step()
        running = eng.scheduler.running
        assert len(running) <= eng.num_slots
        assert [s.slot for s in running] == list(range(len(running)))
        assert all(s.seq_len <= eng.max_seq_len for s in running)
        _, total, used = eng.policy.capacity()
        assert 0 <= used <= total
        peak = max(peak, used)
    assert peak > 0


@pytest.mark.parametrize("kind", POLICIES)
def test_finishing_and_cancelling_free_everything(model, kind):
    """After a workload, and after ``cancel_all`` mid-run, nothing is held: the same workload then runs
    again to the same outputs (nothing leaked, no stale state read)."""
    eng = engine(model, kind, tight=True)
    reqs = requests(temperature=1.0)
    first = outputs(eng.generate(reqs))
    assert eng.policy.capacity()[2] == 0 and not eng.scheduler.running and eng.num_unfinished == 0
    for r in reqs:
        eng.add_request(r)
    for _ in range(6):
        eng.step()
    assert eng.policy.capacity()[2] > 0
    assert cancel_all(eng) > 0
    assert eng.policy.capacity()[2] == 0 and not eng.scheduler.running and eng.num_unfinished == 0
    assert outputs(eng.generate(reqs)) == first


@pytest.mark.parametrize("kind", POLICIES)
def test_a_groups_samples_share_one_prefill_of_their_prompt(model, kind):
    """n samples of one prompt: the prompt is computed once (the others hit it), every sample decodes
    from the same last-position logits (greedy: identical samples), and a policy that counts references
    (``pool``) holds the prompt's full blocks once per sample, all freed at the end."""
    n, prompt = 4, list(range(3, 13))
    eng = engine(model, kind)
    eng.add_request(
        Request(
            request_id="g", prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=6, n=n)
        )
    )
    done = eng.step()
    stats = eng.stats
    assert (stats.prefill_tokens, stats.prefix_hit_tokens) == (len(prompt), (n - 1) * len(prompt))
    pool = getattr(eng.policy, "pool", None)
    if pool is not None:
        shared = eng.scheduler.running[0].blocks[: len(prompt) // pool.block_size]
        assert shared and all(pool.ref_count[b] == n for b in shared)
        assert all(s.blocks[: len(shared)] == shared for s in eng.scheduler.running)
    while eng.num_unfinished:
        done += eng.step()
    assert len({tuple(c.token_ids) for c in done}) == 1 and len(done) == n
    assert eng.policy.capacity()[2] == 0
    if pool is not None:
        assert all(pool.ref_count[b] == 0 for b in shared)


@pytest.mark.parametrize("kind", POLICIES)
def test_running_short_of_cache_changes_no_token(model, kind):
    """A cache too small for the workload at once (the paged policy preempts and readmits; the slot
    policy keeps requests waiting) gives the roomy cache's tokens, log-probs and routed experts."""
    reqs = requests(temperature=0.8, top_k=20, return_routed_experts=True)
    ref = engine(model, kind).generate(reqs)
    tight = engine(model, kind, tight=True)
    out = tight.generate(reqs)
    assert outputs(out) == outputs(ref)
    for a, b in zip(ref, out, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert torch.equal(a.routed_experts, b.routed_experts)
    if kind == "paged":  # the tight size is chosen so that this policy evicts
        assert tight.stats.preemptions > 0
    assert tight.policy.capacity()[2] == 0


@pytest.mark.parametrize("kind", POLICIES)
def test_generate_equals_a_teacher_forced_forward(model, kind):
    """Sampled (T = 0.8, top-p 0.9) under a tight cache: each token's log-prob is log softmax(logits / T)
    of one forward of the model over prompt + response, within 1e-5, and its routed experts are that
    forward's; the same seeds give the same tokens under every policy."""
    reqs = requests(temperature=0.8, top_p=0.9, return_routed_experts=True)
    out = engine(model, kind, tight=True).generate(reqs)
    for c in out:
        full = torch.tensor(c.prompt_ids + c.token_ids)[None]
        with torch.no_grad():
            fwd = model(full, None, torch.arange(full.shape[1])[None], return_routed_experts=True)
        p = len(c.prompt_ids)
        lp = torch.log_softmax(fwd.logits[0, p - 1 : -1].float() / 0.8, -1)
        expected = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-5), (c.request_id, c.sample_index)
        assert torch.equal(c.routed_experts, fwd.routed_experts[0, :-1].long())
    other = engine(model, "slots" if kind != "slots" else "paged").generate(reqs)
    assert outputs(out) == outputs(other)


def test_the_cache_is_named_or_passed_and_settings_of_the_other_kind_are_refused(model):
    eng = Engine(model, cache=SlotCachePolicy, max_slots=2, kv_token_budget=64)
    assert eng.cache_kind == "slots" and eng.num_slots == 2
    with pytest.raises(ValueError, match=r"cache='blocks': expected one of \['paged', 'slots'\]"):
        Engine(model, cache="blocks")
    with pytest.raises(ValueError, match="block_size=4 applies to the paged cache"):
        Engine(model, cache="slots", block_size=4)
    with pytest.raises(ValueError, match="max_seq_len=32 applies to the slot cache"):
        Engine(model, cache="paged", max_seq_len=32)
