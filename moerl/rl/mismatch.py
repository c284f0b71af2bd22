"""Train/rollout mismatch correction: importance weights between the proximal and behaviour policy.

The rollout engine and the trainer compute log-probs with different kernels (and, asynchronously,
different weights), so the tokens were sampled from a behaviour policy pi_behav that differs from
the trainer's proximal policy pi_old. With rho = pi_old(y) / pi_behav(y), the off-policy gradient is
reweighted by a detached weight w (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training", truncated importance sampling):

- ``truncate``: ``w = min(rho, C)``;
- ``mask`` (masked IS, MIS; Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
  from the Training-Inference Mismatch"): ``w = rho`` where ``C_low <= rho <= C_high``, else the token
  (at sequence level: the whole sequence) is dropped (``w = 0``);
- ``icepop`` (Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model",
  arXiv:2510.18855, Sec. 3.1, IcePop): the two-sided mask ``M(rho; alpha, beta) = rho`` inside
  ``[alpha, beta]``, else 0, always per token, with bounds ``[C_low, C_high]`` (IcePop's: [0.5, 5]);
- ``none``: ``w = 1``.

Token-level TIS is the default (``LossPreset.mismatch_mode``); with ``trainer.recompute_proximal`` off
pi_old is the trainer's current policy (read from the training forward, detached), so the correction
costs no extra forward.

At ``sequence`` level, rho is the geometric mean of the sequence's token ratios,
``exp(mean_t log rho_t)``, shared by all its tokens (the length normalization of GSPO,
Zheng et al. 2025, applied to the mismatch ratio).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.rl.presets import LossPreset


@dataclass(frozen=True, slots=True)
class MismatchWeights:
    """Result of the correction stage; all tensors [B, T], detached, 0 at masked-out positions."""

    weights: torch.Tensor
    """Importance weight w per token (multiplies the per-token policy loss)."""
    is_clipped: torch.Tensor
    """True where the weight was truncated or the token dropped."""
    log_rho: torch.Tensor
    """log rho per token (token or sequence level) before truncation."""


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast each row's mean over its masked-in positions back to [B, T]."""
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)
    return (x.sum(dim=1, keepdim=True) / lengths).expand_as(x)


@torch.no_grad()
def mismatch_weights(
    old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, preset: LossPreset
) -> MismatchWeights:
    """Importance weights correcting for the behaviour policy (formulas in the module docstring).

    Args:
        old_logp: [B, T] proximal log-probs (recomputed by the trainer, or the current ones).
        behav_logp: [B, T] the rollout engine's log-probs of the same tokens.
        mask: [B, T] bool; inputs must already be 0 at masked-out positions.
        preset: supplies ``mismatch_mode``, ``mismatch_level``, ``mismatch_cap``, ``mismatch_cap_low``.

    Returns:
        ``MismatchWeights`` with float weights of ``old_logp``'s dtype.
    """
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    log_rho = torch.where(mask, old_logp - behav_logp, zero)
    if preset.mismatch_level == "sequence":
        log_rho = torch.where(mask, _sequence_mean(log_rho, mask), zero)
    rho = log_rho.exp()
    if preset.mismatch_mode == "truncate":
        is_clipped = mask & (rho > preset.mismatch_cap)
        weights = rho.clamp_max(preset.mismatch_cap)
    elif preset.mismatch_mode in ("mask", "icepop"):  # icepop: token level, enforced by LossPreset
        is_clipped = mask & ((rho < preset.mismatch_cap_low) | (rho > preset.mismatch_cap))
        weights = torch.where(is_clipped, zero, rho)
    else:
        is_clipped = torch.zeros_like(mask)
        weights = torch.ones_like(rho)
    return MismatchWeights(weights=torch.where(mask, weights, zero), is_clipped=is_clipped, log_rho=log_rho)


@torch.no_grad()
def rollout_mismatch_sums(
    train_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sums over masked-in tokens of the train/rollout log-prob gap, for step-wide means.

    ``abs_diff``: sum of ``|log pi_train(y_t) - log pi_behav(y_t)|``; ``k3``: sum of the k3 estimate
    (Schulman 2020) of KL(pi_behav || pi_train) from the sampled tokens, ``expm1(-x) + x`` with
    ``x = log pi_behav - log pi_train`` (the tokens were sampled from pi_behav). Sums, not means, so that
    a trainer divides by its global token count (also across ranks).

    Args:
        train_logp: [B, T] the trainer's log-probs (detached). behav_logp: [B, T] the engine's.
        mask: [B, T] bool, True at trained tokens.

    Returns:
        [2] float64: (abs_diff sum, k3 sum).
    """
    zero = torch.zeros((), dtype=torch.float64, device=train_logp.device)
    x = torch.where(mask, behav_logp.double() - train_logp.double(), zero)
    return torch.stack([x.abs().sum(), (torch.expm1(-x) + x).sum()])
