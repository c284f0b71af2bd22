"""Advantage estimators: group-relative, GAE, per-token rewards, value loss, dynamic sampling."""

import math
import warnings

import pytest
import torch

from moerl.rl import gae_advantages, group_advantages, is_group_informative, token_rewards, value_loss

NAN = float("nan")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_exact_zeros(estimator):
    ids = torch.zeros(4, dtype=torch.long)
    assert torch.equal(group_advantages(torch.ones(4), ids, estimator=estimator), torch.zeros(4))
    # 0.35 is not exact in float32: the group mean is not exactly 0.35, yet the result is exactly 0.
    adv = group_advantages(torch.full((8,), 0.35), torch.zeros(8, dtype=torch.long), estimator=estimator)
    assert torch.equal(adv, torch.zeros(8))


def test_seven_equal_and_one_outlier_in_float32():
    rewards = torch.tensor([0.35] * 7 + [0.0], dtype=torch.float32)
    adv = group_advantages(rewards, torch.zeros(8, dtype=torch.long))
    assert adv.dtype == torch.float32
    assert torch.isfinite(adv).all() and adv.abs().max() <= 10
    # One outlier among n = 8 with unbiased std: the others get 1/sqrt(n), the outlier -(n-1)/sqrt(n).
    expected = torch.tensor([1 / math.sqrt(8)] * 7 + [-7 / math.sqrt(8)])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_groups_are_ids_not_batch_order():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0])
    ids = torch.tensor([7, 3, 7, 3])
    # Group 7 = {1, 2}: mean 1.5, unbiased std sqrt(0.5); group 3 = {0, 0}: all equal.
    adv = group_advantages(rewards, ids)
    assert torch.allclose(adv, torch.tensor([-0.5 / math.sqrt(0.5), 0.0, 0.5 / math.sqrt(0.5), 0.0]))


def test_dr_grpo_and_rloo():
    rewards, ids = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, dtype=torch.long)
    assert torch.allclose(group_advantages(rewards, ids, estimator="dr_grpo"), torch.tensor([-1.0, 0.0, 1.0]))
    # RLOO baselines: (2 + 3) / 2, (1 + 3) / 2, (1 + 2) / 2.
    assert torch.allclose(group_advantages(rewards, ids, estimator="rloo"), torch.tensor([-1.5, 0.0, 1.5]))


def test_singleton_groups_get_zero_and_one_warning():
    rewards = torch.tensor([1.0, 0.0, 0.7, 3.0])
    ids = torch.tensor([0, 0, 1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adv = group_advantages(rewards, ids)
    assert len(caught) == 1 and "2 group(s) with a single sample" in str(caught[0].message)
    assert adv[2].item() == 0.0 and adv[3].item() == 0.0
    assert adv[0].item() == pytest.approx(1 / math.sqrt(2))


def test_bad_input_is_named():
    ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rewards has 1 non-finite value.*index \(1,\)"):
        group_advantages(torch.tensor([1.0, NAN, 0.0]), ids)
    with pytest.raises(ValueError, match=r"shape mismatch: rewards \(3,\), group_ids \(4,\)"):
        group_advantages(torch.ones(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        group_advantages(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="estimator='ppo'"):
        group_advantages(torch.ones(3), ids, estimator="ppo")


def test_dynamic_sampling_predicate():
    assert not is_group_informative([1.0, 1.0, 1.0])
    assert not is_group_informative(torch.full((8,), 0.35))
    assert is_group_informative([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="rewards has 1 non-finite"):
        is_group_informative([1.0, NAN])


def test_gae_hand_computed_with_hole_and_padding():
    # Tokens at positions 0, 2, 3 (position 1 is a hole, position 4 padding; both hold NaN).
    rewards = torch.tensor([[0.0, NAN, 0.0, 1.0, NAN]])
    values = torch.tensor([[0.5, NAN, 0.6, 0.7, NAN]])
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta = [0.9*0.6 - 0.5, 0.9*0.7 - 0.6, 1 - 0.7] = [0.04, 0.03, 0.3]; gamma*lam = 0.72.
    a3 = 0.3
    a2 = 0.03 + 0.72 * a3
    a0 = 0.04 + 0.72 * a2
    assert torch.allclose(adv, torch.tensor([[a0, 0.0, a2, a3, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.6, a3 + 0.7, 0.0]]))
    # gamma = lam = 1: the advantage is the return-to-go minus the value.
    adv1, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv1, torch.tensor([[0.5, 0.0, 0.4, 0.3, 0.0]]))
    with pytest.raises(ValueError, match="lam=1.5"):
        gae_advantages(rewards, values, mask, lam=1.5)


def test_token_rewards_fold_kl():
    scores = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.1, 0.2, NAN], [0.0, 0.1, 0.3]])
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=0.5)
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.0 - 0.1, 0.0], [0.0, -0.05, 2.0 - 0.15]]))
    assert torch.equal(token_rewards(scores, mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))


def test_value_loss_clipping():
    v, v_old, ret = torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]])
    # Unclipped (1.5 - 2)^2 = 0.25; clipped prediction 1.2 gives (1.2 - 2)^2 = 0.64; 0.5 * max.
    assert value_loss(v, v_old, ret, clip_eps=0.2).item() == pytest.approx(0.32)
    assert value_loss(v, v_old, ret, clip_eps=None).item() == pytest.approx(0.125)
