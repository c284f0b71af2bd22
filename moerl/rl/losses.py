"""The policy loss: one function over three log-prob sources, configured by a ``LossPreset``.

Log-prob sources, all [B, T] per token and aligned with the tokens (``token_logprobs``):

- ``logp``: the current policy pi_theta (with gradient);
- ``old_logp``: the proximal policy pi_old the PPO ratio is taken against, recomputed by the trainer
  before the update; ``None``: ``logp.detach()`` (one on-policy update, ratio 1);
- ``behav_logp``: the behaviour policy pi_behav that sampled the tokens (the rollout engine's log-probs);
  when given, the mismatch stage (``moerl.rl.mismatch``) reweights each token by pi_old / pi_behav.

This is decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", eq. 3):
clip around the proximal policy, importance-correct from the behaviour policy.

Per-token loss, before aggregation (r the ratio pi_theta / pi_old, A the advantage, sg stop-gradient):

    l_t = w_t * surrogate_t + kl_coef * KL_t - entropy_coef * H_t

with the surrogate of the preset: ``ppo_clip`` ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
(Schulman et al. 2017, eq. 7; asymmetric bounds: DAPO clip-higher, Yu et al. 2025, eq. 10), capped
at ``-c A`` where A < 0 with dual clip (Ye et al. 2020, Sec. 3.3); ``cispo``
``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta`` (MiniMax-M1 2025, eq. 4-5). At sequence
level (GSPO, Zheng et al. 2025, Sec. 4) r is ``s_i = exp(mean_t log r_t)`` in the token-level form
``sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))``: its value is s_i and its gradient is
``s_i grad log pi_theta(y_t)``. The KL term is ``kl_estimate`` against the reference policy (GRPO,
Shao et al. 2024, eq. 3-4); the sum is reduced by ``aggregate`` with the preset's mode.
"""

from __future__ import annotations

import torch

from moerl.rl._checks import as_mask, check_ndim, check_same_shape
from moerl.rl.aggregate import aggregate
from moerl.rl.kl import kl_estimate
from moerl.rl.mismatch import mismatch_weights
from moerl.rl.presets import LossPreset, resolve_preset
from moerl.rl.surrogates import SURROGATES

MAX_LOG_RATIO = 20.0
"""log pi_theta - log pi_old is clamped to +-MAX_LOG_RATIO before exp, so a stale token cannot overflow."""


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log r per token; at sequence level GSPO's token-level form (value log s_i, gradient of logp)."""
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if level == "token":
        return log_ratio
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / lengths  # log s_i, (B, 1)
    return seq_log_ratio.detach() + logp - logp.detach()


def _prepare(
    name: str, t: torch.Tensor | None, mask: torch.Tensor, like: torch.Tensor
) -> torch.Tensor | None:
    """``t`` with masked-out positions replaced by 0 (so NaN there reaches nothing)."""
    if t is None:
        return None
    if t.dim() == 1 and name == "advantages":  # one advantage per sequence
        if t.shape[0] != like.shape[0]:
            raise ValueError(
                f"shape mismatch: logp {tuple(like.shape)}, advantages {tuple(t.shape)} (want [B] or [B, T])"
            )
        t = t.unsqueeze(1).expand_as(like)
    check_same_shape(**{"logp": like, name: t})
    return torch.where(mask, t.to(like.dtype), torch.zeros((), dtype=like.dtype, device=like.device))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    preset: str | LossPreset = "grpo",
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss of a (micro-)batch and its metrics (formulas in the module docstring).

    Args:
        logp: [B, T] current log-probs, float, with gradient.
        old_logp: [B, T] proximal log-probs, or ``None`` for ``logp.detach()``.
        advantages: [B, T] per-token, or [B] per-sequence advantages.
        mask: [B, T] bool or 0/1, True at trained tokens. Every input may hold anything (NaN
            included) at masked-out positions: it is replaced with ``torch.where`` first.
        preset: a ``PRESETS`` name or a ``LossPreset`` (``resolve_preset`` applies overrides).
        behav_logp: [B, T] rollout-engine log-probs; enables the mismatch correction.
        ref_logp: [B, T] reference-policy log-probs for the KL term (needed when ``kl_coef > 0``).
        kl_coef: KL penalty coefficient beta >= 0.
        kl_kind: ``k1``, ``k2`` or ``k3`` (``kl_estimate``).
        entropy: [B, T] per-token entropies (``entropy_from_logits``), with gradient for a bonus.
        entropy_coef: entropy bonus coefficient >= 0.
        num_tokens, num_seqs, norm_length: the optimizer step's global normalizers (``aggregate``).

    Returns:
        ``(loss, metrics)``: the 0-dim loss to backpropagate (micro-batch losses of one step add up to
        the step's loss), and plain floats over masked-in tokens of this batch: ``pg_loss`` (the
        aggregated surrogate term), ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low``,
        ``ppo_kl`` (mean of old_logp - logp), ``num_tokens``; with ``ref_logp``: ``kl``; with
        ``entropy``: ``entropy``; with ``behav_logp``: ``is_weight_mean``, ``is_clipfrac``,
        ``train_rollout_logprob_abs_diff`` (mean |old_logp - behav_logp|). A NaN at a masked-in
        position is not hidden: it makes the loss NaN, for the trainer to skip the step.

    Raises:
        ValueError: shape mismatch (naming the tensors), unknown preset, negative coefficient, or
            ``kl_coef > 0`` without ``ref_logp``.
    """
    preset = resolve_preset(preset)
    check_ndim("logp", logp, 2, "[B, T]")
    check_same_shape(logp=logp, mask=mask)
    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} and entropy_coef={entropy_coef} must be >= 0")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (reference-policy log-probs)")
    mask = as_mask("mask", mask)
    logp_m = _prepare("logp", logp, mask, logp)
    old = _prepare("old_logp", old_logp, mask, logp)
    old = logp_m.detach() if old is None else old.detach()
    adv = _prepare("advantages", advantages, mask, logp).detach()
    behav = _prepare("behav_logp", behav_logp, mask, logp)
    ref = _prepare("ref_logp", ref_logp, mask, logp)
    ent = _prepare("entropy", entropy, mask, logp)

    ratio = _log_ratio(logp_m, old, mask, preset.ratio_level).exp()
    clipped = ratio.clamp(1.0 - preset.eps_low, 1.0 + preset.eps_high)
    pg_t, high, low = SURROGATES[preset.surrogate](ratio, clipped, adv, logp_m, preset)
    weights = None
    if behav is not None and preset.mismatch_mode != "none":
        weights = mismatch_weights(old, behav.detach(), mask, preset)
        pg_t = weights.weights * pg_t

    norms = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": norm_length}
    total_t = pg_t
    kl_t = None if ref is None else kl_estimate(logp_m, ref.detach(), kl_kind)
    if kl_t is not None and kl_coef > 0:
        total_t = total_t + kl_coef * kl_t
    if ent is not None and entropy_coef > 0:
        total_t = total_t - entropy_coef * ent
    loss = aggregate(total_t, mask, preset.aggregation, **norms)

    with torch.no_grad():
        pg_loss = aggregate(pg_t.detach(), mask, preset.aggregation, **norms)
        metrics = _metrics(mask, pg_loss, high, low, old - logp_m.detach(), kl_t, ent, weights, old, behav)
    return loss, metrics


def _metrics(mask, pg_loss, high, low, neg_log_ratio, kl_t, ent, weights, old, behav) -> dict[str, float]:
    """Masked means as plain floats, read back from the device in one transfer."""
    count = mask.sum()
    denom = count.clamp_min(1).to(neg_log_ratio.dtype)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.to(neg_log_ratio.dtype), 0.0).sum() / denom

    named = {
        "pg_loss": pg_loss,
        "pg_clipfrac": mean(high | low),
        "pg_clipfrac_high": mean(high),
        "pg_clipfrac_low": mean(low),
        "ppo_kl": mean(neg_log_ratio),
        "num_tokens": count,
    }
    if kl_t is not None:
        named["kl"] = mean(kl_t.detach())
    if ent is not None:
        named["entropy"] = mean(ent.detach())
    if behav is not None:
        named["train_rollout_logprob_abs_diff"] = mean((old - behav).abs())
    if weights is not None:
        named["is_weight_mean"] = mean(weights.weights)
        named["is_clipfrac"] = mean(weights.is_clipped)
    values = torch.stack([v.detach().to(torch.float64) for v in named.values()]).tolist()
    return dict(zip(named, values, strict=True))
