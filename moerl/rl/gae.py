"""PPO with a value head: per-token rewards (score plus KL penalty), GAE advantages, value loss.

All tensors are [B, T] over response positions, aligned with the tokens (position t holds what
belongs to token y_t). Masked-out positions are skipped: they neither receive an advantage nor
break the recursion, so a hole in the mask (for example tool output) is stepped over.
"""

from __future__ import annotations

import torch

from moerl.rl._checks import as_mask, check_ndim, check_same_shape


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards with the KL penalty folded in: ``r_t = -kl_coef * kl_t``, plus the
    sequence score at its last masked-in token.

    Source: the KL-shaped reward ``R(x, y) = r(x, y) - beta * log(pi(y|x) / pi_ref(y|x))`` of
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2, and
    Ouyang et al. 2022 (InstructGPT), eq. 2, spread over tokens as in their PPO implementations.

    Args:
        scores: [B] float, one scalar reward per sequence.
        mask: [B, T] bool or 0/1, True at response tokens.
        kl: [B, T] per-token KL estimate (``kl_estimate``), or ``None`` for no penalty.
        kl_coef: the penalty coefficient beta >= 0.

    Returns:
        [B, T] float rewards, 0 at masked-out positions (rows without a token get nothing).

    Raises:
        ValueError: bad shapes or ``kl_coef < 0``.
    """
    check_ndim("mask", mask, 2, "[B, T]")
    check_ndim("scores", scores, 1, "[B]")
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"shape mismatch: scores {tuple(scores.shape)}, mask {tuple(mask.shape)} (want [B], [B, T])"
        )
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0")
    mask = as_mask("mask", mask)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    if kl is not None and kl_coef > 0:
        check_same_shape(kl=kl, mask=mask)
        rewards = torch.where(mask, -kl_coef * kl.to(scores.dtype), zero)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1)  # (B,) index of the last token, -1 if none
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(1)
    rewards[rows, last[has_token]] += scores[has_token]
    return rewards


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the masked-in tokens of each sequence.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (V after the last token is 0: the episode ends), and
    ``A_t = sum_l (gamma * lam)^l delta_{t+l}``, computed backwards as ``A_t = delta_t + gamma * lam *
    A_{t+1}``; the value targets are ``returns_t = A_t + V_t``. Source: Schulman et al. 2016,
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation", Sec. 3 (eq. 16).

    Args:
        rewards: [B, T] per-token rewards (``token_rewards``).
        values: [B, T] value-head predictions V_t for the state before token t (no gradient taken).
        mask: [B, T] bool or 0/1.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both [B, T] in ``values``' dtype, 0 at masked-out positions.

    Raises:
        ValueError: bad shapes, or gamma / lam outside [0, 1].
    """
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}={v} must be in [0, 1]")
    check_ndim("values", values, 2, "[B, T]")
    check_same_shape(rewards=rewards, values=values, mask=mask)
    mask = as_mask("mask", mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(mask, rewards.to(values.dtype), zero)
    values = torch.where(mask, values, zero)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m, adv, zero)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
    return advantages, torch.where(mask, advantages + values, zero)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> torch.Tensor:
    """Per-token clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``.

    Source: Schulman et al. 2017, PPO, eq. 9 (squared-error value loss ``(V - V_targ)^2``), with the
    value clipping of the PPO reference implementation (OpenAI Baselines ppo2, Dhariwal et al. 2017).
    ``clip_eps=None`` gives the unclipped ``0.5 * (V - R)^2``.

    Args:
        values: [B, T] current value predictions (with gradient).
        old_values: [B, T] predictions at rollout time.
        returns: [B, T] value targets from ``gae_advantages``.

    Returns:
        [B, T] per-token losses; reduce them with ``aggregate`` and the loss mask.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns)
    unclipped = (values - returns).square()
    if clip_eps is None:
        return 0.5 * unclipped
    if clip_eps <= 0:
        raise ValueError(f"clip_eps={clip_eps} must be > 0 (or None to disable)")
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum(unclipped, (clipped - returns).square())


@torch.no_grad()
def whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked-in entries (population std), 0 elsewhere.

    The per-batch advantage normalization of PPO implementations (Andrychowicz et al. 2021, "What Matters
    in On-Policy Reinforcement Learning?", Sec. 3.5 and the PPO2 baseline); over all tokens of the batch.

    Args:
        x: [B, T] float. mask: [B, T] bool or 0/1.

    Returns:
        [B, T] in ``x``'s dtype; all zeros when no entry is masked in.
    """
    check_same_shape(x=x, mask=mask)
    mask = as_mask("mask", mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = mask.sum().clamp_min(1)
    mean = torch.where(mask, x, zero).sum() / n
    var = torch.where(mask, (x - mean).square(), zero).sum() / n
    return torch.where(mask, (x - mean) / (var.sqrt() + eps), zero)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var[returns - values] / Var[returns]`` over the masked-in entries: 1 for a perfect critic,
    0 for one that predicts the mean, negative for worse (the PPO2 baseline's diagnostic,
    ``explained_variance`` of OpenAI Baselines, Dhariwal et al. 2017). NaN when Var[returns] is 0.

    Args:
        values, returns, mask: [B, T]; values and returns float.
    """
    check_same_shape(values=values, returns=returns, mask=mask)
    mask = as_mask("mask", mask)
    v, r = values[mask].double(), returns[mask].double()
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
