"""Per-token log-probs and entropies aligned with the labels (moerl.rl.logprobs)."""

import math

import pytest
import torch

from moerl.rl import entropy_from_logits, token_logprobs

VOCAB = 16


def _logits_with_entropy(target: float) -> torch.Tensor:
    """Logits [V] = s * (0, 1, ..., V-1) whose softmax has the target entropy (bisection on s)."""
    base = torch.arange(VOCAB, dtype=torch.float64)
    lo, hi = 0.0, 50.0  # entropy falls from log V at s = 0 towards 0
    for _ in range(100):
        mid = (lo + hi) / 2
        p = torch.softmax(mid * base, dim=0)
        entropy = -(p * p.log()).sum().item()
        lo, hi = (mid, hi) if entropy > target else (lo, mid)
    return (lo * base).float()


def test_entropy_at_positions_predicting_labels():
    entropies = [2.0, 2.2, 1.8, 1.5, 1.0, 1.3]
    logits = torch.stack([_logits_with_entropy(h) for h in entropies]).unsqueeze(0)  # [1, 6, V]
    labels = torch.tensor([[-100, -100, -100, 3, 4, 5]])
    out = entropy_from_logits(logits, labels)
    # Labels 3..5 are predicted by positions 2..4: (1.8 + 1.5 + 1.0) / 3.
    mask = labels != -100
    assert out[mask].mean().item() == pytest.approx(1.4333, abs=1e-4)
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, 0.0, 1.8, 1.5, 1.0]]), atol=1e-4)


def test_token_logprobs_match_direct_formula_with_temperature():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[0, :2] = -100
    out = token_logprobs(logits, labels, temperature=0.7)
    assert out.dtype == torch.float32
    for b in range(2):
        for t in range(5):
            if t == 0 or labels[b, t] == -100:
                assert out[b, t].item() == 0.0
                continue
            row = logits[b, t - 1] / 0.7
            expected = row[labels[b, t]] - torch.logsumexp(row, dim=0)
            assert out[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_chunked_gradients_equal_direct_autograd():
    torch.manual_seed(3)
    logits = torch.randn(3, 7, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 7))
    labels[1, 4:] = -100
    weights = torch.randn(3, 7)
    shifted = labels[:, 1:]
    valid = shifted != -100
    logp_direct = torch.log_softmax(logits[:, :-1] / 1.3, dim=-1)

    chunked = token_logprobs(logits, labels, 1.3, chunk_tokens=4) * weights
    direct = logp_direct.gather(-1, shifted.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    direct = torch.where(valid, direct, 0.0) * weights[:, 1:]
    assert torch.allclose(chunked[:, 1:], direct, atol=1e-6)
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    (grad_direct,) = torch.autograd.grad(direct.sum(), logits)
    assert torch.allclose(grad_chunked, grad_direct, atol=1e-6)

    ent = entropy_from_logits(logits, labels, temperature=1.3, chunk_tokens=2) * weights
    logp_direct = torch.log_softmax(logits[:, :-1] / 1.3, dim=-1)
    ent_direct = -(logp_direct.exp() * logp_direct).sum(-1)
    ent_direct = torch.where(valid, ent_direct, 0.0) * weights[:, 1:]
    assert torch.allclose(ent[:, 1:], ent_direct, atol=1e-6)
    (grad_ent,) = torch.autograd.grad(ent.sum(), logits)
    (grad_ent_direct,) = torch.autograd.grad(ent_direct.sum(), logits)
    assert torch.allclose(grad_ent, grad_ent_direct, atol=1e-6)


def test_gradcheck_float64():
    logits = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 4], [0, 3, 1, 2]])
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, 0.8, chunk_tokens=3), (logits,), fast_mode=True
    )
    assert torch.autograd.gradcheck(
        lambda x: entropy_from_logits(x, labels, chunk_tokens=3), (logits,), fast_mode=True
    )


def test_bf16_logits_are_computed_in_float32():
    logits = torch.zeros(1, 2, VOCAB, dtype=torch.bfloat16)
    labels = torch.tensor([[0, 5]])
    assert token_logprobs(logits, labels)[0, 1].item() == pytest.approx(-math.log(VOCAB), abs=1e-6)
    assert entropy_from_logits(logits, labels)[0, 1].item() == pytest.approx(math.log(VOCAB), abs=1e-5)


def test_bad_input():
    logits = torch.zeros(1, 3, VOCAB)
    with pytest.raises(ValueError, match=r"shape mismatch: logits \(1, 3, 16\), labels \(1, 2\)"):
        token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="id 16 outside the vocabulary"):
        token_logprobs(logits, torch.tensor([[0, 16, 1]]))
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(logits, torch.zeros(1, 3, dtype=torch.long), temperature=0)
