"""Loss aggregation modes and global normalizers (moerl.rl.aggregate)."""

import pytest
import torch

from moerl.rl import aggregate, policy_loss, resolve_preset

NAN = float("nan")


def _two_sequences():
    # Per-token losses [2, 2, 2, 2, 2] and [10]: 5 and 1 valid tokens; padding holds NaN.
    values = torch.tensor([[2.0, 2.0, 2.0, 2.0, 2.0], [10.0, NAN, NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return values, mask


def test_modes_on_hand_computed_example():
    values, mask = _two_sequences()
    # token-mean: (5 * 2 + 10) / 6 tokens; seq-mean-token-mean: (2 + 10) / 2 sequences.
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(20 / 6)
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(3.3333, abs=1e-4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(6.0)
    # seq-mean-token-sum: (10 + 10) / 2; Dr. GRPO constant length 5: 20 / (2 * 5).
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(10.0)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(2.0)
    # Default constant length is T (= 5 here); a global one changes the value.
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(1.0)


def test_advantage_sign_depends_on_the_mode():
    # Advantages [+1, -1], lengths [1, 3], ratio 1, no KL: per-token losses [-1] and [+1, +1, +1].
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0])
    seq, _ = policy_loss(logp, logp, advantages, mask, preset="grpo")
    tok, _ = policy_loss(
        logp, logp, advantages, mask, preset=resolve_preset("grpo", aggregation="token-mean")
    )
    assert seq.item() == pytest.approx(0.0)
    assert tok.item() == pytest.approx(0.5)


def test_micro_batches_with_global_count_match_one_batch():
    # A: 2 tokens with loss 1 each; B: 6 tokens with loss 3 each; losses are scale * constant.
    scale = torch.tensor(1.0, requires_grad=True)
    const_a, const_b = torch.ones(1, 2), torch.full((1, 6), 3.0)
    mask_a, mask_b = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)
    loss_a = aggregate(scale * const_a, mask_a, "token-mean", num_tokens=8)
    loss_b = aggregate(scale * const_b, mask_b, "token-mean", num_tokens=8)
    (grad_accumulated,) = torch.autograd.grad(loss_a + loss_b, scale)
    assert (loss_a + loss_b).item() == pytest.approx(2.5)  # (2 * 1 + 6 * 3) / 8

    # The same 8 tokens as one padded batch [2, 6].
    const_one = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [3.0] * 6])
    mask_one = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6], dtype=torch.bool)
    one = aggregate(scale * const_one, mask_one, "token-mean")
    (grad_one,) = torch.autograd.grad(one, scale)
    assert one.item() == pytest.approx(2.5)
    assert grad_accumulated.item() == pytest.approx(grad_one.item())  # both 20 / 8
    assert grad_one.item() == pytest.approx(2.5)
    # Per-micro-batch normalizers would give 1 + 3 instead: the global count matters.
    assert (aggregate(const_a, mask_a) + aggregate(const_b, mask_b)).item() == pytest.approx(4.0)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_policy_loss_gradient_accumulation_equals_one_batch(mode):
    torch.manual_seed(1)
    batch, seq_len = 6, 5
    weight = torch.randn(seq_len, requires_grad=True)
    features = torch.randn(batch, seq_len)
    old_logp = -torch.rand(batch, seq_len)
    advantages = torch.randn(batch)
    mask = torch.arange(seq_len) < torch.tensor([5, 3, 1, 4, 2, 5]).unsqueeze(1)
    preset = resolve_preset("dapo", aggregation=mode)
    norms = {"num_tokens": int(mask.sum()), "num_seqs": batch, "norm_length": seq_len}

    def loss_of(rows):
        logp = old_logp[rows] + 0.3 * torch.tanh(features[rows] * weight)
        loss, _ = policy_loss(logp, old_logp[rows], advantages[rows], mask[rows], preset=preset, **norms)
        return loss

    one = loss_of(slice(0, batch))
    (grad_one,) = torch.autograd.grad(one, weight)
    parts = [loss_of(slice(0, 2)), loss_of(slice(2, 5)), loss_of(slice(5, 6))]
    (grad_acc,) = torch.autograd.grad(sum(parts), weight)
    assert sum(parts).item() == pytest.approx(one.item(), rel=1e-6)
    assert torch.allclose(grad_acc, grad_one, atol=1e-6)


def test_bad_input():
    values, mask = _two_sequences()
    with pytest.raises(ValueError, match="mode='mean'"):
        aggregate(values, mask, "mean")
    with pytest.raises(ValueError, match=r"shape mismatch: values \(2, 5\), mask \(2, 4\)"):
        aggregate(values, mask[:, :4])
    with pytest.raises(ValueError, match="num_tokens=0"):
        aggregate(values, mask, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match=r"values must have shape \[B, T\]"):
        aggregate(values[0], mask[0])


def test_empty_batch_gives_zero():
    values = torch.full((2, 3), NAN)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        assert aggregate(values, mask, mode).item() == 0.0
