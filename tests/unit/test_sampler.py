"""Sampler: log-prob convention, truncation, reproducibility and the distribution of the samples."""

import math

import pytest
import torch

from moerl.rollout.params import SamplingParams
from moerl.rollout.sampler import (
    SamplingRows,
    mix32,
    sample_key,
    sample_no_sync,
    token_logprobs,
    truncation_mask,
    uniform_no_sync,
)


def _rows(b, *, temperature=1.0, top_k=0, top_p=1.0, keys=None):
    return SamplingRows(
        temperature=torch.full((b,), float(temperature)),
        top_k=torch.full((b,), top_k, dtype=torch.int64),
        top_p=torch.full((b,), float(top_p)),
        keys=torch.tensor(keys if keys is not None else [sample_key(0, i) for i in range(b)]),
        all_greedy=temperature == 0.0,
        any_truncation=top_k > 0 or top_p < 1.0,
    )


def test_two_token_vocab_logprob_at_half_temperature():
    # softmax([2, 0] / 0.5) = softmax([4, 0]); log p0 = -log(1 + e^-4) = -0.0181499...
    lp = token_logprobs(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), 0.5)
    assert lp.dtype == torch.float32
    assert lp.item() == pytest.approx(-math.log1p(math.exp(-4.0)), abs=1e-7)
    assert round(lp.item(), 5) == -0.01815


def test_sampled_logprob_is_before_truncation_and_greedy_uses_t1():
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0]])
    tok, lp = sample_no_sync(logits, _rows(1, temperature=0.7, top_k=1), torch.tensor([5]))
    assert tok.item() == 0  # top-1 leaves only the argmax
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.7, -1)[0, 0].item(), abs=1e-7)
    tok, lp = sample_no_sync(logits, _rows(1, temperature=0.0), torch.tensor([5]))
    assert tok.item() == 0
    assert lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item(), abs=1e-7)


def test_truncation_mask_top_k_then_top_p_by_hand():
    # probs of [log .5, log .3, log .15, log .05]: top-p 0.7 keeps .5 and .3 (mass before .3 is .5 < .7)
    scaled = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    keep = truncation_mask(scaled, torch.tensor([0]), torch.tensor([0.7]))
    assert keep.tolist() == [[False, True, False, True]]
    # top-k 3 first: renormalized .5/.95=.526, .3/.95=.316 -> mass before 3rd is .842 >= .8: 2 kept
    keep = truncation_mask(scaled, torch.tensor([3]), torch.tensor([0.8]))
    assert keep.tolist() == [[False, True, False, True]]
    # top-p 0.85 with top-k 3: .842 < .85, the third (.15) is kept too; .05 is cut by top-k
    keep = truncation_mask(scaled, torch.tensor([3]), torch.tensor([0.85]))
    assert keep.tolist() == [[True, True, False, True]]
    keep = truncation_mask(scaled, torch.tensor([0]), torch.tensor([1.0]))
    assert keep.all()


def test_samples_follow_the_softmax_distribution():
    # 20000 independent rows (different sample indices) of the same logits; frequencies within 4 sigma.
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, -3.0])
    n = 20000
    for top_k, top_p in [(0, 1.0), (3, 1.0), (0, 0.8)]:
        rows = _rows(
            n, temperature=0.8, top_k=top_k, top_p=top_p, keys=[sample_key(123, i) for i in range(n)]
        )
        tok, _ = sample_no_sync(logits.expand(n, -1), rows, torch.full((n,), 7))
        scaled = (logits / 0.8)[None]
        keep = truncation_mask(scaled, torch.tensor([top_k]), torch.tensor([top_p]))[0]
        p = torch.softmax(scaled[0].masked_fill(~keep, float("-inf")), -1)
        freq = torch.bincount(tok, minlength=5).double() / n
        sigma = torch.sqrt(p * (1 - p) / n).double()
        assert (freq - p.double()).abs().le(4 * sigma + 1e-12).all(), (top_k, top_p, freq, p)
        assert freq[~keep].sum() == 0


def test_noise_depends_only_on_seed_sample_and_position():
    logits = torch.randn(4, 50)
    keys = [sample_key(s, i) for s, i in [(1, 0), (1, 1), (2, 0), (-5, 3)]]
    tok, lp = sample_no_sync(logits, _rows(4, keys=keys), torch.tensor([3, 3, 3, 9]))
    # the same rows in another order and batch composition give the same tokens
    perm = [3, 1, 0, 2]
    other = torch.randn(3, 50)
    tok2, lp2 = sample_no_sync(
        torch.cat([other, logits[perm]]),
        _rows(7, keys=[11, 12, 13] + [keys[i] for i in perm]),
        torch.tensor([1, 2, 3] + [[3, 3, 3, 9][i] for i in perm]),
    )
    assert tok2[3:].tolist() == tok[perm].tolist()
    assert torch.equal(lp2[3:], lp[perm])
    u = uniform_no_sync(torch.tensor(keys), torch.tensor([3, 3, 3, 9]))
    assert len(set(u.tolist())) == 4 and ((u >= 0) & (u < 1)).all()


def test_uniforms_are_uniform_and_mix32_matches_on_ints_and_tensors():
    keys = torch.tensor([sample_key(0, i) for i in range(4000)])
    u = uniform_no_sync(keys.repeat(5), torch.arange(5).repeat_interleave(4000))
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 4 * math.sqrt(2000 * 0.9)
    assert abs(u.mean().item() - 0.5) < 0.01
    xs = [0, 1, 12345, 2**32 - 1]
    assert mix32(torch.tensor(xs)).tolist() == [mix32(x) for x in xs]
    assert all(0 <= mix32(x) < 2**32 for x in xs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"n": 0}, "n=0"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": (-1,)}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
