"""Rollout engine on tiny moerl models: exact log-probs, batch invariance, stops, weight updates, bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rl import token_logprobs as rl_token_logprobs
from moerl.rollout import Engine, InvalidRequestError, Request, SamplingParams, token_logprobs

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


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _req(rid, prompt, **kw):
    return Request(request_id=rid, prompt_ids=prompt, params=SamplingParams(**kw))


def test_sampled_logprobs_equal_trainer_recomputation(model):
    prompts = _prompts([4, 11, 7])
    reqs = [
        _req(
            f"r{i}",
            p,
            temperature=0.7,
            max_new_tokens=10,
            n=2,
            seed=i,
            top_k=20 if i == 1 else 0,
            top_p=0.9 if i == 2 else 1.0,
        )
        for i, p in enumerate(prompts)
    ]
    outs = Engine(model, max_slots=4, kv_token_budget=4 * 32).generate(reqs)
    assert len(outs) == 6
    # the trainer's way: one right-padded batch forward over prompt + completion, then moerl.rl's
    # token_logprobs (log softmax(logits / T), labels aligned with input ids, ignore_index off-response)
    seqs = [c.prompt_ids + c.token_ids for c in outs]
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (c, s) in enumerate(zip(outs, seqs, strict=True)):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        labels[i, len(c.prompt_ids) : len(s)] = torch.tensor(c.token_ids)
    with torch.no_grad():
        logits = model(ids, mask).logits
    trainer_lp = rl_token_logprobs(logits, labels, 0.7)
    for i, c in enumerate(outs):
        p, g = len(c.prompt_ids), len(c.token_ids)
        ref = trainer_lp[i, p : p + g]
        diff = (torch.tensor(c.logprobs) - ref).abs().max().item()
        assert diff < 1e-5, (c.request_id, diff)
        assert torch.exp(torch.tensor(c.logprobs) - ref).sub(1).abs().max() < 1e-4  # importance ratio 1.000
        own = token_logprobs(logits[i, p - 1 : p + g - 1], torch.tensor(c.token_ids), 0.7)
        assert (own - ref).abs().max() < 1e-6
    assert outs[0].token_ids != outs[1].token_ids  # the two samples of a group differ


def test_batch_invariance_greedy_and_seeded(model):
    target_prompt = _prompts([6], seed=5)[0]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=42, top_p=0.95)):
        alone = Engine(model, max_slots=4, kv_token_budget=4 * 48).generate(
            [_req("x", target_prompt, max_new_tokens=16, **kw)]
        )[0]
        engine = Engine(model, max_slots=3, kv_token_budget=3 * 48)
        others = _prompts([3, 9, 2, 13, 5], seed=6)
        # two others start first; the target joins after 2 steps; others finish early and new ones join
        engine.add_request(_req("o0", others[0], max_new_tokens=3, temperature=0.0))
        engine.add_request(_req("o1", others[1], max_new_tokens=20, temperature=0.9, seed=1))
        done = engine.step() + engine.step()
        engine.add_request(_req("x", target_prompt, max_new_tokens=16, **kw))
        for i, p in enumerate(others[2:]):
            engine.add_request(_req(f"o{i + 2}", p, max_new_tokens=4 + i, temperature=0.5, n=2))
        while engine.num_unfinished:
            done += engine.step()
        got = next(c for c in done if c.request_id == "x")
        assert got.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
        assert len(done) == 1 + 2 + 2 * 3


def test_compaction_moves_several_slots_at_once(model):
    # 8 slots: the three short requests (slots 0-2) finish in the same step, so the long ones in slots 5-7
    # move down to 0-2 in one batched copy, each with its own cached length (prompts of 3 to 10 tokens)
    prompts = _prompts([3, 4, 5, 6, 7, 8, 9, 10], seed=9)
    lengths = [2, 2, 2, 12, 12, 12, 12, 12]
    alone = [
        Engine(model, max_slots=1, kv_token_budget=48).generate(
            [_req(f"r{i}", p, max_new_tokens=n, temperature=0.0)]
        )[0]
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    engine = Engine(model, max_slots=8, kv_token_budget=8 * 48)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(_req(f"r{i}", p, max_new_tokens=n, temperature=0.0))
    moves = []
    release = engine.scheduler.release
    engine.scheduler.release = lambda finished: moves.append(release(finished)) or moves[-1]
    done = []
    while engine.num_unfinished:
        done += engine.step()
    assert sorted(len(m) for m in moves if m) == [3]  # the batched path ran with several moves
    got = {c.request_id: c for c in done}
    for i, want in enumerate(alone):
        assert got[f"r{i}"].token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got[f"r{i}"].logprobs), torch.tensor(want.logprobs), atol=1e-5)


def test_sync_every_and_buckets_do_not_change_outputs(model):
    prompts = _prompts([5, 8, 3, 10])
    reqs = [
        _req(f"r{i}", p, temperature=0.8, max_new_tokens=6 + 3 * i, seed=i, stop_token_ids=(7, 8, 9))
        for i, p in enumerate(prompts)
    ]
    ref = Engine(model, max_slots=2, kv_token_budget=2 * 32).generate(reqs)
    out = Engine(model, max_slots=3, kv_token_budget=3 * 32, sync_every=4, batch_buckets=(4,)).generate(reqs)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for c in ref:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in (7, 8, 9) else "length")
        assert not any(t in (7, 8, 9) for t in c.token_ids[:-1])


def test_group_shares_one_prefill_and_greedy_samples_agree(model):
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, ids, *a, **kw):
            calls.append(tuple(ids.shape))
            return self.inner(ids, *a, **kw)

    engine = Engine(Counting(model), max_slots=4, kv_token_budget=4 * 32)
    outs = engine.generate([_req("g", _prompts([9])[0], temperature=0.0, max_new_tokens=5, n=4)])
    assert [c.sample_index for c in outs] == [0, 1, 2, 3]
    assert all(c.token_ids == outs[0].token_ids for c in outs)
    assert calls[0] == (1, 9) and all(s == (4, 1) for s in calls[1:])  # one prefill row, 4 decode rows


def test_routed_experts_match_full_forward(model):
    out = Engine(model, max_slots=2, kv_token_budget=64).generate(
        [_req("r", _prompts([5])[0], temperature=1.0, seed=3, max_new_tokens=6, return_routed_experts=True)]
    )[0]
    seq = torch.tensor(out.prompt_ids + out.token_ids[:-1])[None]
    with torch.no_grad():
        ref = model(seq, return_routed_experts=True).routed_experts[0]
    assert out.routed_experts.shape == ref.shape == (10, 2, 2)
    assert torch.equal(out.routed_experts.sort(-1).values, ref.sort(-1).values)


class ScriptedLM(torch.nn.Module):
    """Deterministic next token: ``successor[input token]``; writes zeros through the KV-cache seam."""

    def __init__(self, successor: dict[int, int], vocab: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=vocab,
            max_position_embeddings=64,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
            hidden_size=2,
        )
        table = torch.arange(vocab)
        for a, b in successor.items():
            table[a] = b
        self.register_buffer("table", table)
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(
        self, ids, attention_mask=None, position_ids=None, *, cache=None, return_routed_experts=False
    ):
        b, t = ids.shape
        if cache is not None:
            kv = torch.zeros(b, 1, t, 2)
            cache.update(0, kv, kv)
            assert cache.attn_mask.shape[:3] == (b, 1, t)
        logits = (
            10.0 * torch.nn.functional.one_hot(self.table[ids], self.config.vocab_size).float() + self.weight
        )
        return SimpleNamespace(logits=logits, routed_experts=None)


def test_stop_token_equal_to_pad_ends_generation_and_is_in_the_mask():
    eos = pad = 0
    lm = ScriptedLM({3: 5, 5: 7, 7: eos, eos: 9, 9: 9})
    engine = Engine(lm, max_slots=2, kv_token_budget=64)
    out = engine.generate(
        [
            _req("s", [2, 3], temperature=0.0, max_new_tokens=10, stop_token_ids=(eos,)),
            _req("l", [2, 3], temperature=0.0, max_new_tokens=2, stop_token_ids=(eos,)),
        ]
    )
    assert out[0].token_ids == [5, 7, pad] and out[0].finish_reason == "stop"
    assert out[0].loss_mask == [1, 1, 1] and len(out[0].logprobs) == 3
    assert out[1].token_ids == [5, 7] and out[1].finish_reason == "length"
    # a stop token in the prompt does not stop anything; one as the first generated token does
    out = engine.generate(
        [
            _req("p", [eos, 3], temperature=0.0, max_new_tokens=4, stop_token_ids=(eos,)),
            _req("f", [7], temperature=0.0, max_new_tokens=4, stop_token_ids=(eos, 9)),
        ]
    )
    assert out[0].token_ids == [5, 7, eos]
    assert out[1].token_ids == [eos] and out[1].finish_reason == "stop"
    # with sync_every > 1 the tokens sampled after the stop are discarded
    out = Engine(lm, max_slots=2, kv_token_budget=64, sync_every=8).generate(
        [_req("s", [3], temperature=0.0, max_new_tokens=20, stop_token_ids=(eos,))]
    )
    assert out[0].token_ids == [5, 7, eos]


def test_update_weights_changes_only_later_tokens_and_versions(model):
    import copy

    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    new_weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    prompts = _prompts([5, 7, 4], seed=9)
    greedy = dict(temperature=0.0, max_new_tokens=8)
    old = Engine(copy.deepcopy(model), max_slots=2, kv_token_budget=64).generate(
        [_req(str(i), p, **greedy) for i, p in enumerate(prompts)]
    )
    new = Engine(new_model, max_slots=2, kv_token_budget=64, version=7).generate(
        [_req(str(i), p, **greedy) for i, p in enumerate(prompts)]
    )

    engine = Engine(copy.deepcopy(model), max_slots=2, kv_token_budget=64)
    before = engine.cache.k
    engine.add_request(_req("0", prompts[0], **greedy))
    done = engine.step() + engine.step() + engine.step()  # 4 tokens with version 0
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    engine.update_weights(new_weights, version=7)
    assert engine.version == 7 and engine.cache.k is before
    assert [p.data_ptr() for p in engine.model.parameters()] == ptrs  # copied in place
    engine.add_request(_req("2", prompts[2], **greedy))
    while engine.num_unfinished:
        done += engine.step()
    mid, late = sorted(done, key=lambda c: c.request_id)
    assert mid.policy_versions == [0] * 4 + [7] * 4
    assert mid.token_ids[:4] == old[0].token_ids[:4]
    assert late.policy_versions == [7] * 8 and late.token_ids == new[2].token_ids
    assert old[2].token_ids != new[2].token_ids  # the update does change outputs
    with pytest.raises(KeyError, match="nope"):
        engine.update_weights({"nope": torch.zeros(1)}, version=8)
    name, t = next(iter(new_weights.items()))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(*t.shape, 2))], version=8)
    assert engine.version == 7


def test_bad_requests_fail_alone(model):
    engine = Engine(model, max_slots=2, kv_token_budget=2 * 32)
    good = [
        _req("a", _prompts([4])[0], temperature=0.0, max_new_tokens=5),
        _req("b", _prompts([6])[0], temperature=0.7, seed=1, max_new_tokens=5),
    ]
    bad_params = SamplingParams(max_new_tokens=4)
    bad_params.n = 0
    neg_temp = SamplingParams(max_new_tokens=4)
    neg_temp.temperature = -1.0
    bad = [
        (_req("empty", [], max_new_tokens=4), "empty prompt"),
        (_req("long", [1] * 40, max_new_tokens=4), "longer than the context"),
        (_req("nofit", [1] * 20, max_new_tokens=20), "can never fit"),
        (Request(request_id="n0", prompt_ids=[1, 2], params=bad_params), "n=0"),
        (Request(request_id="t", prompt_ids=[1, 2], params=neg_temp), "temperature"),
        (_req("vocab", [1, VOCAB + 3], max_new_tokens=4), "outside the vocabulary"),
        (_req("neg", [1, -2], max_new_tokens=4), "outside the vocabulary"),
    ]
    for req, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request(req)
    ref = Engine(model, max_slots=2, kv_token_budget=64).generate(good)
    mixed = [good[0]] + [r for r, _ in bad] + [good[1]]
    with pytest.raises(InvalidRequestError, match="'empty'"):
        engine.generate(mixed)
    out = engine.generate(mixed, on_error="return")
    assert [c.finish_reason for c in out][1:-1] == ["error"] * len(bad)
    assert out[0].token_ids == ref[0].token_ids and out[-1].token_ids == ref[1].token_ids
    assert "can never fit" in out[3].error
    engine.add_request(good[0])
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request(good[0])


def test_admission_waits_for_free_slots():
    lm = ScriptedLM({})  # every token repeats itself: runs to max_new_tokens
    engine = Engine(lm, max_slots=8, kv_token_budget=2 * 16, max_seq_len=16)
    assert engine.num_slots == 2 and engine.max_seq_len == 16
    for i in range(5):
        engine.add_request(_req(str(i), [i + 1], temperature=0.0, max_new_tokens=3 + i, n=1 + i % 2))
    finished, peak = [], 0
    while engine.num_unfinished:
        finished += engine.step()
        peak = max(peak, len(engine.scheduler.running))
        assert [s.slot for s in engine.scheduler.running] == list(range(len(engine.scheduler.running)))
    assert peak == 2 and len(finished) == 7
    # a group larger than the slots is admitted in parts (each part prefills the prompt again)
    group = engine.generate([_req("big", [4], temperature=1.0, seed=0, max_new_tokens=3, n=5)])
    assert [c.sample_index for c in group] == [0, 1, 2, 3, 4] and all(c.token_ids == [4, 4, 4] for c in group)
    assert all(c.token_ids == [int(c.request_id) + 1] * (3 + int(c.request_id)) for c in finished)


def test_from_config_sizes_engine_and_sampling():
    from moerl.config import RolloutConfig

    cfg = RolloutConfig(
        max_slots=4,
        kv_token_budget=4 * 20,
        group_size=3,
        temperature=0.6,
        top_k=5,
        max_new_tokens=7,
        sync_every=2,
    )
    engine = Engine.from_config(ScriptedLM({}), cfg, version=3)
    assert (engine.num_slots, engine.max_seq_len, engine.sync_every, engine.version) == (4, 20, 2, 3)
    p = SamplingParams.from_config(cfg, stop_token_ids=(1,), seed=9)
    assert (p.n, p.temperature, p.top_k, p.max_new_tokens, p.stop_token_ids, p.seed) == (
        3,
        0.6,
        5,
        7,
        (1,),
        9,
    )
    outs = engine.generate([Request(request_id="g", prompt_ids=[2], params=p)])
    assert len(outs) == 3 and all(c.policy_versions == [3] * 7 for c in outs)


def test_engine_rejects_sizes_without_room():
    with pytest.raises(ValueError, match="no cache slot"):
        Engine(ScriptedLM({}), max_slots=4, kv_token_budget=4)
    with pytest.raises(ValueError, match="sync_every=0"):
        Engine(ScriptedLM({}), max_slots=4, kv_token_budget=64, sync_every=0)
    engine = Engine(ScriptedLM({}), max_slots=4, kv_token_budget=1000)  # slots capped by the model context
    assert (engine.num_slots, engine.max_seq_len) == (4, 64)
    assert engine.cache.k.shape == (1, 4, 1, 64, 2)


def test_sync_every_defaults_to_the_devices_value(model):
    """No ``sync_every`` given (config None): 8 decode steps between host copies on CUDA, 1 on CPU."""
    from moerl.config import load_config
    from moerl.rollout.engine import GPU_SYNC_EVERY, default_sync_every

    assert default_sync_every(torch.device("cuda", 0)) == GPU_SYNC_EVERY == 8
    assert default_sync_every(torch.device("cpu")) == 1
    cfg = load_config(None, []).rollout
    assert cfg.sync_every is None  # no knob a GPU user must set
    assert Engine(model, max_slots=2, kv_token_budget=64).sync_every == 1
    assert Engine.from_config(model, cfg, cache="paged").sync_every == 1
    assert Engine(model, max_slots=2, kv_token_budget=64, sync_every=3).sync_every == 3
