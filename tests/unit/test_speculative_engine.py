"""Speculative decoding in the engine over the paged cache policy (float32, CPU): every sampled token's log-prob is the
policy's teacher-forced one, greedy output is identical with and without speculation, R3 records are
those of the accepted tokens, and speculation turns itself off where it does not pay."""

from __future__ import annotations

import pytest
import torch

from moerl.config import ModelConfig, RolloutConfig
from moerl.models import build_model
from moerl.models.mtp import attach_fresh_mtp
from moerl.rollout import Request, SamplingParams
from moerl.rollout.engine import Engine
from moerl.rollout.sampler import token_logprobs
from moerl.rollout.spec_decode import SpeculativeDecoding
from moerl.rollout.speculative import NgramDrafter, SpecPolicy

VOCAB = 23


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return attach_fresh_mtp(m)


def _requests(n=2, max_new_tokens=16, **kw):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in (5, 11, 7)]
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=p,
            params=SamplingParams(max_new_tokens=max_new_tokens, n=n, seed=i, **kw),
        )
        for i, p in enumerate(prompts)
    ]


def _engine(model, speculative="off", k=3, **kw):
    """A paged engine; speculating (when on) at every step whatever the acceptance (exactness tests)."""
    cfg = RolloutConfig(
        max_slots=16,
        kv_token_budget=2048,
        kv_block_size=4,
        speculative=speculative,
        speculative_tokens=k,
        **kw,
    )
    engine = Engine.from_config(model, cfg, cache="paged", seed=0)
    if engine.speculation is not None:
        engine.speculation.policy = SpecPolicy(min_acceptance=0.0)
    return engine


def _teacher_forced(model, c, temperature):
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
    return token_logprobs(logits, torch.tensor(c.token_ids), temperature if temperature > 0 else 1.0)


def _by_id(completions):
    return sorted(completions, key=lambda c: (c.request_id, c.sample_index))


@pytest.mark.parametrize("speculative", ["ngram", "mtp"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=8)])
def test_logprobs_are_the_policys_teacher_forced(model, speculative, sampling):
    engine = _engine(model, speculative)
    out = engine.generate(_requests(**sampling))
    stats = engine.stats
    assert stats.spec_steps > 0 and stats.spec_drafted > 0 and stats.spec_accepted > 0  # it did speculate
    for c in out:
        ref = _teacher_forced(model, c, sampling["temperature"])
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5), (c.request_id, c.sample_index)


class _OracleDrafter(NgramDrafter):
    """Proposes the reference greedy continuation with every third draft made wrong: the engine's
    accept and reject paths both run, with real accepted tokens."""

    def __init__(self, reference):
        super().__init__()
        self.reference = reference  # prompt tuple -> greedy tokens

    def propose(self, requests, rows, k):
        d = super().propose(requests, rows, k)
        tokens, counts = torch.zeros_like(d.tokens), torch.zeros_like(d.num_drafts)
        for r, req in enumerate(requests):
            prompt = next(p for p in self.reference if tuple(req.context[: len(p)]) == p)
            ref = self.reference[prompt][len(req.context) - len(prompt) :][: min(k, req.max_drafts)]
            wrong = [(t + 1) % VOCAB if (len(req.context) + j) % 3 == 0 else t for j, t in enumerate(ref)]
            tokens[r, : len(ref)] = torch.tensor(wrong, dtype=torch.int64)
            counts[r] = len(ref)
        return type(d)(tokens=tokens, num_drafts=counts)


@pytest.mark.parametrize("speculative", ["ngram", "mtp", "oracle"])
def test_greedy_identical_with_and_without_speculation(model, speculative):
    ref = _by_id(_engine(model).generate(_requests(n=1, temperature=0.0, return_routed_experts=True)))
    if speculative == "oracle":
        engine = _engine(model)
        table = {tuple(c.prompt_ids): c.token_ids for c in ref}
        engine.speculation = SpeculativeDecoding(_OracleDrafter(table), 3, SpecPolicy(min_acceptance=0.0))
    else:
        engine = _engine(model, speculative)
    out = _by_id(engine.generate(_requests(n=1, temperature=0.0, return_routed_experts=True)))
    stats = engine.stats
    assert stats.spec_drafted > 0
    if speculative == "oracle":
        assert 0 < stats.spec_accepted < stats.spec_drafted  # accepts and rejects both ran
    for a, b in zip(ref, out, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert torch.equal(b.routed_experts, a.routed_experts)  # R3: the accepted tokens' routing only


class _WrongDrafter(NgramDrafter):
    """Always proposes a token the greedy policy never picks next (acceptance 0)."""

    def propose(self, requests, rows, k):
        d = super().propose(requests, rows, k)
        return type(d)(
            tokens=torch.full_like(d.tokens, VOCAB - 1),
            num_drafts=torch.tensor([min(k, r.max_drafts) for r in requests]),
        )


def test_speculation_turns_off_where_it_does_not_pay(model):
    engine = _engine(model)
    engine.speculation = SpeculativeDecoding(
        _WrongDrafter(), 3, SpecPolicy(max_batch=4, min_acceptance=0.3, probe_every=8)
    )
    pol = engine.speculation.policy
    big = engine.generate(_requests(n=2, max_new_tokens=8, temperature=0.0))  # 6 sequences > max_batch
    assert pol.num_off_batch > 0 and pol.num_spec_steps == 0  # the large batch decoded plainly
    one = engine.generate(_requests(n=1, max_new_tokens=30, temperature=0.0)[:1])
    assert pol.acceptance_rate == 0.0
    assert pol.num_off_acceptance > 2 * pol.num_spec_steps > 0  # acceptance 0: plain steps, a few probes
    ref = _engine(model)
    expect = ref.generate(_requests(n=2, max_new_tokens=8, temperature=0.0))
    expect += ref.generate(_requests(n=1, max_new_tokens=30, temperature=0.0)[:1])
    assert [c.token_ids for c in _by_id(big + one)] == [c.token_ids for c in _by_id(expect)]


def test_speculative_config_is_checked():
    from moerl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.speculative"):
        RolloutConfig(speculative="eagle")
    with pytest.raises(ConfigError, match="kv_cache=paged"):
        RolloutConfig(speculative="ngram", kv_cache="slots")
    with pytest.raises(ConfigError, match="speculative_tokens"):
        RolloutConfig(speculative="ngram", speculative_tokens=0)


def test_engine_refuses_speculation_over_a_policy_without_draft_room(model):
    cfg = RolloutConfig(max_slots=4, kv_token_budget=256, speculative="ngram")
    with pytest.raises(ValueError, match="room_for_drafts"):
        Engine.from_config(model, cfg, cache="slots")


def test_engine_stats_reach_the_metrics(model):
    from moerl.telemetry.step import kv_values

    engine = _engine(model, "ngram")
    assert kv_values([engine.stats])["rollout/spec_acceptance_rate"] is None  # nothing speculated yet
    engine.generate(_requests(n=1, max_new_tokens=12, temperature=0.0))
    values = kv_values([engine.stats])
    pol = engine.speculation.policy
    assert values["rollout/spec_acceptance_rate"] == pol.acceptance_rate
    assert values["rollout/spec_accepted_per_step"] == pol.accepted_per_step
    assert values["timing/spec_draft_s"] > 0


def test_run_policy_gets_an_mtp_module_where_the_config_needs_one():
    from moerl.config import load_config
    from moerl.runtime.build import load_policy

    cfg = load_config(None, ["rollout.speculative=mtp"])
    assert len(load_policy(cfg, None, VOCAB).mtp_layers) == 1
    assert len(load_policy(load_config(None, []), None, VOCAB).mtp_layers) == 0


@pytest.mark.parametrize("speculative", ["mtp", "ngram"])
def test_greedy_and_logprobs_under_cuda_sync_defaults(model, speculative):
    """The engine's CUDA defaults, on CPU: host syncs every 8 steps overlapped with the next decode, and
    speculation turned on and off within a run by batch size (plain steps while more than 3 of the 6 rows
    run); stop tokens finish sequences mid-step."""
    stop = 3

    def engine_of(speculative: str) -> Engine:  # built directly: from_config keeps CPU's sync every step
        engine = Engine(
            model,
            cache="paged",
            max_slots=16,
            kv_token_budget=2048,
            block_size=4,
            sync_every=8,
            overlap_sync=True,
        )
        rollout = RolloutConfig(speculative=speculative, speculative_tokens=3)
        engine.speculation = SpeculativeDecoding.from_config(model, rollout)
        if engine.speculation is not None:
            engine.speculation.policy = SpecPolicy(max_batch=3, min_acceptance=0.0)
        return engine

    def requests(temperature: float):
        return _requests(max_new_tokens=30, temperature=temperature, stop_token_ids=[stop])

    plain = _by_id(engine_of("off").generate(requests(0.0)))
    engine = engine_of(speculative)
    spec = _by_id(engine.generate(requests(0.0)))
    assert [(c.token_ids, c.finish_reason) for c in spec] == [(c.token_ids, c.finish_reason) for c in plain]
    policy = engine.speculation.policy
    assert policy.num_spec_steps > 0 and policy.num_off_batch > 0  # both kinds of step ran
    assert any(c.finish_reason == "stop" for c in spec)
    for c in _by_id(engine_of(speculative).generate(requests(1.0))):
        assert torch.allclose(torch.tensor(c.logprobs), _teacher_forced(model, c, 1.0), atol=1e-5), (
            c.request_id
        )
        assert len(c.token_ids) <= 30 and (c.finish_reason == "stop") == (c.token_ids[-1] == stop)
