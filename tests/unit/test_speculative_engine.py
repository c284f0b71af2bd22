"""Speculative decoding in the engine over the paged cache policy (float32, CPU): every sampled token's log-prob is the
policy's teacher-forced one, greedy output is identical with and without speculation, R3 records are
those of the accepted tokens, and speculation turns itself off where it does not pay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moerl.config import ModelConfig, RolloutConfig
from moerl.models import build_model
from moerl.models.mtp import attach_fresh_mtp
from moerl.rollout import Request, SamplingParams
from moerl.rollout.engine import Engine
from moerl.rollout.sampler import token_logprobs
from moerl.rollout.spec_decode import SpeculativeDecoding, verify_forward_no_sync
from moerl.rollout.speculative import NgramDrafter, SpecPolicy, step_noise

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
        engine.speculation.policy = SpecPolicy(min_acceptance=0.0, clock=_STOPPED)
    return engine


def _STOPPED() -> float:
    """A clock that never moves: no cost measurement, so the cost rule never turns speculation off."""
    return 0.0


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
        policy = SpecPolicy(min_acceptance=0.0, clock=_STOPPED)
        engine.speculation = SpeculativeDecoding(_OracleDrafter(table), 3, policy)
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


def test_speculation_turns_off_where_it_is_slower(model):
    """The cost rule, with an injected clock: each speculative step takes 10 s of it, a plain step 0.01 s
    (acceptance alone would keep speculating: min_acceptance 0)."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.01
        return now[0]

    class _Slow(_WrongDrafter):
        def propose(self, requests, rows, k):
            now[0] += 10.0
            return super().propose(requests, rows, k)

    engine = _engine(model)
    policy = SpecPolicy(min_acceptance=0.0, probe_every=8, clock=clock)
    engine.speculation = SpeculativeDecoding(_Slow(), 3, policy)
    out = engine.generate(_requests(n=1, max_new_tokens=40, temperature=0.0)[:1])
    assert policy.is_slower() and policy.num_off_acceptance == 0 and policy.num_plain_probes > 0
    assert policy.num_off_cost > 2 * policy.num_spec_steps > 0  # plain steps, a probe every 8
    stats = engine.stats
    assert stats.spec_off_cost == policy.num_off_cost and stats.spec_step_ms > stats.plain_step_ms > 0
    ref = _engine(model).generate(_requests(n=1, max_new_tokens=40, temperature=0.0)[:1])
    assert out[0].token_ids == ref[0].token_ids


@pytest.mark.parametrize("k", [1, 3])
def test_decode_path_verify_equals_the_prefill_path(model, k):
    """The verify forward as decode rows sharing their sequence's block-table row gives the logits and
    hidden states of the prefill-path verify (rows of different lengths, drafts 0..k, shared prompt
    blocks within each group of two samples)."""
    from moerl.rollout.cache_policy import PrefillRow

    engine = _engine(model)
    for r in _requests(n=2, max_new_tokens=16):
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    engine._sync_all()
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 6 and len({s.seq_len for s in seqs}) == 3
    assert any(a.blocks[0] == b.blocks[0] for a in seqs for b in seqs if a is not b)  # shared blocks
    b = len(seqs)
    wanted = [min(n, k) for n in (3, 1, 0, 2, 3, 2)]
    counts = [engine.policy.room_for_drafts(s, n) for s, n in zip(seqs, wanted, strict=True)]
    assert counts == wanted
    drafts = torch.randint(0, VOCAB, (b, k), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits, hidden = verify_forward_no_sync(
            engine,
            b,
            k,
            engine._read_len(seqs, extra=k),
            drafts,
            torch.tensor(counts),
            False,
            want_hidden=True,
        )
        rows = [
            PrefillRow(s, list(s.request.prompt_ids) + s.token_ids + drafts[i, :n].tolist(), s.seq_len - 1)
            for i, (s, n) in enumerate(zip(seqs, counts, strict=True))
        ]
        ref, ref_hidden = engine._forward_prefill(rows, False, want_hidden=True)
    for i, n in enumerate(counts):
        assert torch.allclose(logits[i, : n + 1], ref[i, : n + 1], atol=1e-5), i
        assert torch.allclose(hidden[i, : n + 1], ref_hidden[i, : n + 1], atol=1e-5), i


def test_mtp_ring_holds_the_policys_hidden_states(model):
    """After prefill, plain and speculative steps, each running row's MTP ring holds the teacher-forced
    final hidden state and next token of its last ``window`` fed positions, and the device drafter's q
    equals the MTP module run on that window."""
    import dataclasses

    from moerl.rollout.speculative import policy_probs

    engine = _engine(model, "mtp")
    spec = engine.speculation
    short, *rest = _requests(n=2, max_new_tokens=24)
    short = dataclasses.replace(short, params=dataclasses.replace(short.params, max_new_tokens=4))
    for r in [short, *rest]:
        engine.add_request(r)
    engine.step()
    slots = {id(s): s.slot for s in engine.scheduler.running}
    for i in range(6):
        spec.policy.max_batch = 0 if i % 3 == 0 else 32  # plain steps between speculative ones
        engine.step()
    engine._sync_all()
    seqs = list(engine.scheduler.running)
    assert seqs and spec.policy.num_spec_steps > 0 and spec.policy.num_off_batch > 1
    assert any(slots[id(s)] != s.slot for s in seqs)  # the short request finished: rows moved up
    ring, b = spec.drafter, len(seqs)
    rows = engine._rows(slice(0, b), seqs)
    with torch.no_grad():
        last_fed = engine._seq_len[:b] - 2
        drafts, q = ring.draft_no_sync(last_fed, rows, 2, step_noise(rows.keys, last_fed + 2, 2).draft)
        for i, s in enumerate(seqs):
            ids = list(s.request.prompt_ids) + s.token_ids
            last = len(ids) - 2  # the last fed position
            h = model(torch.tensor([ids[:-1]]), return_hidden=True).hidden[0]
            lo = max(0, last - ring.window + 1)
            for p in range(lo, last + 1):
                assert torch.allclose(ring.hidden[s.slot, p % ring.columns], h[p], atol=1e-5), (i, p)
                assert int(ring.next_ids[s.slot, p % ring.columns]) == ids[p + 1]
            hid, nxt = h[None, lo : last + 1], torch.tensor([ids[lo + 1 : last + 2]])
            pos = torch.arange(lo + 1, last + 2)[None]
            for j in range(2):
                hj, lg = model.mtp_layers[0](model, hid, nxt, pos)
                row = engine._rows(slice(i, i + 1), [s])
                assert torch.allclose(q[i, j], policy_probs(lg[:, -1:], row)[0, 0], atol=1e-5), (i, j)
                hid, pos = torch.cat([hid, hj[:, -1:]], 1), torch.cat([pos, pos[:, -1:] + 1], 1)
                nxt = torch.cat([nxt, drafts[i : i + 1, j : j + 1]], 1)


def test_one_host_read_per_host_drafted_step(model):
    """A step drafted on the host (n-gram: it needs the whole context) reads the device once (its counts
    and tokens, with every pending token); a second read only where tokens of a plain step or a prefill
    were pending when it began."""
    engine = _engine(model, "ngram")
    spec, reads, per_step = engine.speculation, [0], []
    engine.host.on_read = lambda: reads.__setitem__(0, reads[0] + 1)
    real_step = spec.step

    def step(eng):
        pending, before, steps = bool(eng.host), reads[0], spec.policy.num_spec_steps
        out = real_step(eng)
        if spec.policy.num_spec_steps > steps:  # it speculated (not a plain fallback)
            per_step.append((pending, reads[0] - before))
        return out

    spec.step = step
    engine.generate(_requests(n=1, max_new_tokens=20, temperature=1.0))
    assert len(per_step) > 3
    assert all(n == 1 + pending for pending, n in per_step)
    assert sum(1 for pending, n in per_step if not pending) >= 2


def test_mtp_steps_read_nothing_between_the_engines_syncs(model):
    """The device drafter's steps plan from upper bounds (``Sequence.unread``) and read no token: the host
    reads at the engine's syncs (every 8 steps here), where a sequence may have reached its length limit
    and where a worst-case length outgrew its blocks; the output is that of the plain engine."""
    engine = _engine(model, "mtp")
    engine.host.sync_every = 8
    engine.speculation.policy = SpecPolicy(min_acceptance=0.0, probe_every=10**6, clock=_STOPPED)
    spec, reads, calls, real_read = engine.speculation, [0], [0], engine.host.on_read
    engine.host.on_read = lambda: (reads.__setitem__(0, reads[0] + 1), real_read())
    real_step = spec.step

    def step(eng):
        drafted = spec.num_drafted
        out = real_step(eng)
        calls[0] += spec.num_drafted > drafted  # it speculated (not a plain fallback)
        for s in eng.scheduler.running:  # the device never passes a sequence's max_new_tokens
            assert int(eng._seq_len[s.slot]) <= s.prompt_len + s.request.params.max_new_tokens
        return out

    def requests():  # one sequence ends while the others still draft
        reqs = _requests(n=1, max_new_tokens=80, temperature=0.0)
        return [dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=n))
                for r, n in zip(reqs, (21, 80, 47), strict=True)]  # fmt: skip

    spec.step = step
    out = engine.generate(requests())
    assert calls[0] > 20 and spec.policy.num_spec_steps >= calls[0] - 1  # read later, all but the last
    assert reads[0] <= calls[0] // 3, (reads[0], calls[0])
    ref = _engine(model).generate(requests())
    assert [c.token_ids for c in _by_id(out)] == [c.token_ids for c in _by_id(ref)]


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
            engine.speculation.policy = SpecPolicy(max_batch=3, min_acceptance=0.0, clock=_STOPPED)
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
