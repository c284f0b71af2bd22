"""Overlapped host sync (``overlap_sync``): the next decode is enqueued before the host reads the tokens of a
started copy, and completions stay the same (tokens, finish reasons, policy versions, routed experts
identical; log-probs within 1e-5: a finished row's extra step changes that step's batch, and with it
float rounding), for the slot and the paged engine, float32 on CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import Engine, Request, SamplingParams
from moerl.rollout.weight_update import cancel_all, recompute_running

VOCAB = 61
STOPS = (3, 17)  # ~1 token in 30 stops a sample: some finish early, some at their length limit


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m


def _requests(routed=False):
    gen = torch.Generator().manual_seed(3)
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist(),
            params=SamplingParams(
                temperature=1.0,
                max_new_tokens=(1, 12, 30, 20)[i],
                n=4,
                seed=i,
                stop_token_ids=STOPS,
                return_routed_experts=routed,
            ),
        )
        for i in range(4)
    ]


def _engine(kind, m, overlap, sync_every, small=False, rows=8):
    """``rows`` sequences at once (the 16 samples of ``_requests`` wait for room below 16)."""
    if kind == "slots":
        return Engine(
            m, max_slots=rows, kv_token_budget=rows * 64, sync_every=sync_every, overlap_sync=overlap
        )
    budget = 120 if small else 2000  # 30 blocks of 4 for 16 samples of up to 43 tokens: preemption
    return Engine(
        m,
        cache="paged",
        max_slots=rows + 4,
        kv_token_budget=budget,
        block_size=4,
        sync_every=sync_every,
        overlap_sync=overlap,
    )


def _same(ref, out, routed=False):
    assert [(c.request_id, c.sample_index) for c in out] == [(c.request_id, c.sample_index) for c in ref]
    for a, b in zip(ref, out, strict=True):
        assert b.token_ids == a.token_ids, (a.request_id, a.sample_index)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert (b.finish_reason, b.policy_versions) == (a.finish_reason, a.policy_versions)
        if routed:
            assert torch.equal(b.routed_experts, a.routed_experts)


class _Order:
    """Records the order of an engine's decodes, started copies and reads of them."""

    def __init__(self, engine):
        self.events: list[str] = []
        for owner, name in ((engine, "_decode"), (engine.host, "stage"), (engine.host, "read_staged")):
            setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name, fn):
        def call(*a, **kw):
            self.events.append(name)
            return fn(*a, **kw)

        return call

    def decodes_between_copy_and_read(self) -> int:
        """Started copies whose read came after a decode enqueued in between."""
        n, started = 0, False
        for e in self.events:
            if e == "stage":
                started = True
            elif e == "_decode" and started:
                n, started = n + 1, False
        return n


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize("sync_every", [1, 4])
def test_overlap_keeps_every_completion_and_decodes_before_reading(model, kind, sync_every):
    routed = kind == "paged"
    reqs = _requests(routed=routed)
    ref = _engine(kind, model, False, sync_every, small=True).generate(reqs)
    assert {c.finish_reason for c in ref} == {"stop", "length"}
    engine = _engine(kind, model, True, sync_every, small=True)
    order = _Order(engine)
    _same(ref, engine.generate(reqs), routed=routed)
    assert order.decodes_between_copy_and_read() > 0
    assert not engine.host and engine.host.staged is None  # nothing left over for the next batch
    if kind == "paged":
        assert engine.stats.preemptions > 0 and engine.stats.blocks_used == 0
    # and again on the same engine: no state carried over
    _same(ref, engine.generate(reqs), routed=routed)


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_overlap_with_weight_update_recompute_and_cancel_between_steps(model, kind):
    # every sample runs from the first step (room for 16): no admission waits for a slot the overlap frees
    # a step later, so an update at the same step meets the same tokens (with requests waiting, their
    # admission and versions may shift by a step: the Engine docstring)
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in model.named_parameters() if "norm" not in n}
    results, steps = [], None
    for overlap in (True, False):
        engine = _engine(kind, copy.deepcopy(model), overlap, 3, rows=16)
        for r in _requests():
            engine.add_request(r)
        done, n = [], 0
        while n < (steps or 20) and (steps or engine.host.staged is None):
            done += engine.step()
            n += 1
        if overlap:
            assert engine.host.staged is not None  # the update lands while a copy is started
            steps = n  # the engine syncing in place takes the same steps
        engine.update_weights(new, 1)
        done += recompute_running(engine)
        while engine.num_unfinished:
            done += engine.step()
        results.append(sorted(done, key=lambda c: (c.request_id, c.sample_index)))
    _same(*results)
    assert any(1 in c.policy_versions for c in results[0]) and any(0 in c.policy_versions for c in results[0])
    engine = _engine(kind, copy.deepcopy(model), True, 3)
    for r in _requests():
        engine.add_request(r)
    for _ in range(10):
        engine.step()
        if engine.host.staged is not None:
            break
    assert engine.host.staged is not None
    assert cancel_all(engine) > 0
    assert not engine.host and engine.host.staged is None and engine.num_unfinished == 0
    _same(_engine(kind, model, False, 3).generate(_requests()), engine.generate(_requests()))


def test_overlap_is_off_on_cpu_by_default(model):
    assert Engine(model, max_slots=2, kv_token_budget=128).host.overlap is False
    assert Engine(model, cache="paged", max_slots=2, kv_token_budget=128, block_size=4).host.overlap is False


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_sequence_at_its_limit_is_synced_not_decoded_again(model, kind):
    # prompt + max_new_tokens fill a slot (64) / the model's context (128) exactly: one more decode would
    # write past it, so a sync that a length limit forces is never overlapped, also for a request admitted
    # (one new token) while a copy is started
    n = 64 if kind == "slots" else 128
    gen = torch.Generator().manual_seed(5)

    def req(rid, new):
        prompt = torch.randint(0, VOCAB, (n - new,), generator=gen).tolist()
        return Request(
            request_id=rid, prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=new, n=2)
        )

    full, late = req("full", 30), req("late", 1)
    results, rows = [], []
    for overlap in (False, True):
        engine = _engine(kind, model, overlap, 4)
        order = _Order(engine)
        engine.add_request(full)
        done = engine.step() + engine.step() + engine.step()
        assert (engine.host.staged is not None) == overlap
        engine.add_request(late)
        while engine.num_unfinished:
            done += engine.step()
        results.append(sorted(done, key=lambda c: (c.request_id, c.sample_index)))
        assert engine.stats.decode_steps == 29  # the first token of each comes from its prefill
        rows.append(engine.stats.decode_rows)
    _same(*results)
    assert rows[0] == rows[1] == 2 * 29  # no row decoded past its limit, not even once
    assert [len(c.token_ids) for c in results[1]] == [30, 30, 1, 1]
    assert order.decodes_between_copy_and_read() > 0


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_rows_that_stop_while_a_step_is_in_flight_leave_nothing_pending(model, kind):
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    greedy = dict(temperature=0.0, max_new_tokens=40, n=2)
    free = _engine(kind, model, False, 1).generate(
        [Request(request_id="a", prompt_ids=prompt, params=SamplingParams(**greedy))]
    )
    toks = free[0].token_ids
    stop = next(t for i, t in enumerate(toks) if i >= 6 and t not in toks[:i])  # first seen at step >= 6
    req = Request(request_id="a", prompt_ids=prompt, params=SamplingParams(stop_token_ids=(stop,), **greedy))
    for sync_every in (1, 3):
        engine = _engine(kind, model, True, sync_every)
        out = engine.generate([req])
        assert [c.finish_reason for c in out] == ["stop", "stop"] and out[0].token_ids[-1] == stop
        # the step decoded after the stop token, before the host read it, is dropped with its rows
        assert not engine.host and engine.host.steps == 0


def test_rollout_config_turns_the_overlap_off(model, monkeypatch):
    from moerl.config import RolloutConfig

    seen = []
    original = Engine._init_state

    def spy(self, num_slots, seed, sync_every, cuda_graphs, overlap_sync):
        seen.append(overlap_sync)
        original(self, num_slots, seed, sync_every, cuda_graphs, overlap_sync)

    monkeypatch.setattr(Engine, "_init_state", spy)
    for cache in ("slots", "paged"):
        Engine.from_config(
            model, RolloutConfig(max_slots=4, kv_token_budget=256, overlap_sync=False), cache=cache
        )
        Engine.from_config(model, RolloutConfig(max_slots=4, kv_token_budget=256), cache=cache)
    assert seen == [False, None, False, None]  # None: on where the device is asynchronous (CUDA)
