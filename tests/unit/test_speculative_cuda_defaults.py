"""Speculative decoding under the engine's CUDA defaults, on CPU: host syncs every 8 steps, overlapped with
the next decode (``overlap_sync``), speculation turned on and off within a run by batch size. Greedy
output equals the engine's without speculation, and every sampled token's log-prob is the policy's
teacher-forced one (float32), with stop tokens finishing sequences mid-step."""

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
from moerl.rollout.speculative import SpecPolicy

VOCAB = 23
STOP = 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return attach_fresh_mtp(m)


def _requests(temperature: float) -> list[Request]:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in (5, 11, 7)]
    params = dict(max_new_tokens=30, n=2, temperature=temperature, stop_token_ids=[STOP])
    return [
        Request(request_id=f"r{i}", prompt_ids=p, params=SamplingParams(seed=i, **params))
        for i, p in enumerate(prompts)
    ]


def _engine(model, speculative: str) -> Engine:
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
    if engine.speculation is not None:  # plain steps while more than 3 of the 6 rows run, then speculative
        engine.speculation.policy = SpecPolicy(max_batch=3, min_acceptance=0.0)
    return engine


def _sorted(completions):
    return sorted(completions, key=lambda c: (c.request_id, c.sample_index))


@pytest.mark.parametrize("speculative", ["mtp", "ngram"])
def test_greedy_and_logprobs_under_cuda_sync_defaults(model, speculative):
    plain = _sorted(_engine(model, "off").generate(_requests(0.0)))
    engine = _engine(model, speculative)
    spec = _sorted(engine.generate(_requests(0.0)))
    assert [(c.token_ids, c.finish_reason) for c in spec] == [(c.token_ids, c.finish_reason) for c in plain]
    policy = engine.speculation.policy
    assert policy.num_spec_steps > 0 and policy.num_off_batch > 0  # both kinds of step ran
    assert any(c.finish_reason == "stop" for c in spec)
    for c in _sorted(_engine(model, speculative).generate(_requests(1.0))):
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
        want = token_logprobs(logits, torch.tensor(c.token_ids), 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-5), c.request_id
        assert len(c.token_ids) <= 30 and (c.finish_reason == "stop") == (c.token_ids[-1] == STOP)
