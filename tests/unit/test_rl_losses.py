"""Policy loss, KL estimators and the mismatch-correction stage (moerl.rl.losses, kl, mismatch)."""

import math

import pytest
import torch

from moerl.rl import kl_estimate, policy_loss, resolve_preset

NAN = float("nan")


def test_k3_is_nonnegative_for_tiny_log_ratio_in_float32():
    logp = torch.tensor([1e-6], dtype=torch.float32)
    ref = torch.zeros(1, dtype=torch.float32)
    k3 = kl_estimate(logp, ref, "k3")
    # exp(-x) - 1 + x = x^2 / 2 + O(x^3) = 5e-13; the naive float32 formula is negative here.
    assert k3.item() >= 0.0
    assert k3.item() == pytest.approx(5e-13, rel=0.25)
    assert (torch.exp(-logp) - 1 + logp).item() < 0


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([0.5, -0.5]), torch.zeros(2)
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -0.5]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.125]))
    expected = torch.tensor([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5])
    assert torch.allclose(kl_estimate(logp, ref, "k3"), expected)
    with pytest.raises(ValueError, match="kind='k4'"):
        kl_estimate(logp, ref, "k4")
    with pytest.raises(ValueError, match=r"shape mismatch: logp \(2,\), ref_logp \(3,\)"):
        kl_estimate(logp, torch.zeros(3))


def test_nan_in_masked_old_logprob_reaches_nothing():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, NAN]])
    advantages = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[1, 0]])
    behav = torch.tensor([[0.0, NAN]])
    loss, metrics = policy_loss(logp, old, advantages, mask, behav_logp=behav, ref_logp=old, kl_coef=0.1)
    assert loss.item() == -1.0
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_loss"] == -1.0
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1].item() == 0.0


def test_clip_higher_and_dual_clip_hand_values():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(5.0)]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    preset = resolve_preset("dapo", dual_clip_c=3.0)
    loss, metrics = policy_loss(logp, old, advantages, mask, preset=preset)
    # Token 0: A > 0, ratio 1.5 clipped to 1.28 -> loss -1.28, no gradient.
    # Token 1: A < 0, ratio 5: max(5, 1.28) = 5, dual clip caps it at c = 3 -> no gradient.
    assert loss.item() == pytest.approx((-1.28 + 3.0) / 2)
    assert metrics["pg_clipfrac_high"] == 0.5 and metrics["pg_clipfrac_low"] == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(1, 2))
    # Without dual clip the second token's loss is -r A = 5 with gradient r / 2 = 2.5.
    loss2, _ = policy_loss(logp, old, advantages, mask, preset="dapo")
    assert loss2.item() == pytest.approx((-1.28 + 5.0) / 2)
    (grad2,) = torch.autograd.grad(loss2, logp)
    assert grad2[0, 1].item() == pytest.approx(2.5)


def test_truncated_importance_sampling_token_level():
    logp = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    behav = torch.tensor([[-math.log(3.0), -math.log(1.2)]])  # rho = pi_old / pi_behav = 3, 1.2
    advantages = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, old, advantages, mask, preset="dapo", behav_logp=behav)
    assert loss.item() == pytest.approx(-(2.0 + 1.2) / 2)  # weights min(3, 2), 1.2
    assert m["is_weight_mean"] == pytest.approx(1.6) and m["is_clipfrac"] == 0.5
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx((math.log(3) + math.log(1.2)) / 2)
    masked = resolve_preset("dapo", mismatch_mode="mask")
    loss_m, m_m = policy_loss(logp, old, advantages, mask, preset=masked, behav_logp=behav)
    assert loss_m.item() == pytest.approx(-1.2 / 2)  # rho = 3 > C_high = 2 is dropped
    assert m_m["is_clipfrac"] == 0.5
    off = resolve_preset("dapo", mismatch_mode="none")
    loss_off, m_off = policy_loss(logp, old, advantages, mask, preset=off, behav_logp=behav)
    assert loss_off.item() == pytest.approx(-1.0) and "is_weight_mean" not in m_off


def test_sequence_level_importance_weight_is_geometric_mean():
    old = torch.zeros(1, 3)
    behav = torch.tensor([[-math.log(2.0), -math.log(0.5), NAN]])  # rho 2 and 0.5; third is padding
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    preset = resolve_preset("dapo", mismatch_level="sequence")
    loss, m = policy_loss(old, old, torch.ones(1, 3), mask, preset=preset, behav_logp=behav)
    assert m["is_weight_mean"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert loss.item() == pytest.approx(-1.0)


def test_kl_and_entropy_terms():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    entropy = torch.tensor([[0.8, 1.2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, 2)
    loss, m = policy_loss(
        logp, None, adv, mask, ref_logp=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01
    )
    k3 = math.exp(-0.5) - 1 + 0.5
    assert m["kl"] == pytest.approx(k3 / 2) and m["entropy"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(0.1 * k3 / 2 - 0.01 * 1.0)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
        policy_loss(logp, None, adv, mask, kl_coef=0.1)


def test_bad_input_names_tensors():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shape mismatch: logp \(2, 3\), old_logp \(2, 4\)"):
        policy_loss(logp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"shape mismatch: logp \(2, 3\), advantages \(3,\)"):
        policy_loss(logp, logp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="preset='reinforce'"):
        policy_loss(logp, logp, torch.zeros(2), torch.ones(2, 3), preset="reinforce")
