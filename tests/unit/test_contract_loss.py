"""Contract of a policy loss (``moerl.rl.surrogates.SURROGATES``, ``moerl.rl.presets.PRESETS``;
docs/extending.md "Loss"): every registered surrogate and preset, and any new one, must

- at the behaviour policy (ratio 1) give each token the policy gradient d loss / d log pi = -A (the
  on-policy gradient all these objectives share: Schulman et al. 2017, eq. 6-7; MiniMax-M1 2025, eq. 4),
  with per-token loss and bool clip flags of the input's shape [B, T];
- as a preset through ``policy_loss``: a finite scalar loss, no gradient when every advantage is 0, and
  nothing from masked-out tokens, whatever they hold (NaN included).
"""

from __future__ import annotations

import pytest
import torch

from moerl.rl import policy_loss
from moerl.rl.presets import PRESETS, LossPreset
from moerl.rl.surrogates import SURROGATES

B, T = 3, 5


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=gen) * 3).requires_grad_()
    adv = torch.randn(B, T, generator=gen, dtype=torch.float32)
    return logp, adv


def check_surrogate_contract(surrogate, preset: LossPreset) -> None:
    """Assert the surrogate contract at ratio 1 (module docstring); AssertionError naming the rule."""
    logp, adv = _batch()
    ratio = torch.exp(logp - logp.detach())  # 1, with the gradient of log pi
    clipped = ratio.clamp(1.0 - preset.eps_low, 1.0 + preset.eps_high)
    loss, high, low = surrogate(ratio, clipped, adv, logp, preset)
    assert loss.shape == high.shape == low.shape == (B, T), "loss and flags are per token [B, T]"
    assert high.dtype == low.dtype == torch.bool, "clip flags are bool"
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad, -adv, atol=1e-6), "at ratio 1 the gradient per token is -A"


@pytest.mark.parametrize("name", sorted(SURROGATES))
def test_registered_surrogate_gives_the_policy_gradient_on_policy(name):
    check_surrogate_contract(SURROGATES[name], LossPreset(name="contract", surrogate=name))


def test_a_surrogate_with_the_wrong_gradient_is_refused():
    def doubled(ratio, clipped, adv, logp, preset):
        return -2 * ratio * adv, ratio > 2, ratio < 0

    with pytest.raises(AssertionError, match="gradient per token is -A"):
        check_surrogate_contract(doubled, PRESETS["grpo"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_registered_preset_is_finite_silent_without_advantage_and_blind_to_masked_tokens(name):
    logp, adv = _batch(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -2:] = False
    loss, _ = policy_loss(logp, None, adv, mask, preset=name, num_tokens=float(mask.sum()), num_seqs=float(B))
    assert loss.dim() == 0 and torch.isfinite(loss)
    (zero,) = torch.autograd.grad(
        policy_loss(
            logp, None, torch.zeros(B, T), mask, preset=name, num_tokens=float(mask.sum()), num_seqs=float(B)
        )[0],
        logp,
    )
    assert torch.count_nonzero(zero) == 0, "no advantage, no gradient"
    garbage_logp, garbage_adv = logp.detach().clone(), adv.clone()
    garbage_logp[~mask], garbage_adv[~mask] = float("nan"), float("nan")
    garbage_logp.requires_grad_()
    masked, _ = policy_loss(
        garbage_logp, None, garbage_adv, mask, preset=name, num_tokens=float(mask.sum()), num_seqs=float(B)
    )
    assert torch.equal(masked.detach(), loss.detach()), "masked-out tokens changed the loss"
