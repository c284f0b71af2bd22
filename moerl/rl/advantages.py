"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO) and GAE with a value head (PPO).

Group estimators take one scalar reward per sample and an explicit group id per sample (samples of
one prompt share an id); they never assume that a group is contiguous in the batch. Group
statistics are computed in float64 and the result is cast back to the rewards' dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moerl.rl._checks import check_finite, check_ndim, check_same_shape

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""Estimators that ``group_advantages`` accepts."""


@dataclass(frozen=True, slots=True)
class _GroupStats:
    """Statistics of each sample's group, per sample [N], float64."""

    count: torch.Tensor
    """Samples in the group."""
    centered: torch.Tensor
    """R_i - mean_g."""
    std: torch.Tensor
    """Unbiased (n - 1) standard deviation of the group's rewards."""
    spread: torch.Tensor
    """max_g - min_g; exactly 0 when all rewards of the group are equal."""


def _group_stats(rewards: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> _GroupStats:
    """Per-sample statistics of the sample's group; ``inverse`` maps samples to groups 0..G-1."""
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.index_add(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    # Unbiased (n - 1) variance, as torch.std; singletons are handled by the caller.
    var = zeros.index_add(0, inverse, centered.square()) / (count - 1).clamp_min(1)
    high = zeros.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    low = zeros.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return _GroupStats(
        count=count[inverse], centered=centered, std=var.sqrt()[inverse], spread=(high - low)[inverse]
    )


def _grpo(stats: _GroupStats, std_floor: float) -> torch.Tensor:
    adv = stats.centered / stats.std.clamp_min(std_floor)
    return torch.where(stats.spread == 0, torch.zeros_like(adv), adv)


def _dr_grpo(stats: _GroupStats, std_floor: float) -> torch.Tensor:
    return stats.centered


def _rloo(stats: _GroupStats, std_floor: float) -> torch.Tensor:
    count = stats.count
    return stats.centered * count / (count - 1).clamp_min(1)


_ESTIMATORS = {"grpo": _grpo, "dr_grpo": _dr_grpo, "rloo": _rloo}
assert tuple(_ESTIMATORS) == GROUP_ESTIMATORS


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str = "grpo",
    std_floor: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per sample.

    Estimators (R_i the reward of sample i, its group g of n samples, mean_g / std_g over g):

    - ``grpo``: ``(R_i - mean_g) / max(std_g, std_floor)``, std unbiased (n - 1). Shao et al. 2024,
      DeepSeekMath, Sec. 4.1.2 (outcome supervision). A floor rather than the usual ``std + eps`` keeps
      the paper's value for every group with a spread, and a group whose rewards are all equal (in
      the given dtype) gets exactly 0, never NaN or a blown-up quotient of rounding noise.
    - ``dr_grpo``: ``R_i - mean_g`` (no std division). Liu et al. 2025, "Understanding R1-Zero-Like
      Training: A Critical Perspective" (Dr. GRPO), Sec. 3.1.
    - ``rloo``: ``R_i - mean_{j != i} R_j = n / (n - 1) * (R_i - mean_g)``. Kool et al. 2019, "Buy 4
      REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024, "Back to Basics", eq. 4.

    A group with one sample has no baseline: its advantage is 0, and one warning per call reports
    how many such groups there were.

    Args:
        rewards: [N] float, finite.
        group_ids: [N] integer ids; samples with the same id form a group.
        estimator: one of ``GROUP_ESTIMATORS``.
        std_floor: smallest std divided by (``grpo`` only), > 0.

    Returns:
        Advantages [N] with the dtype of ``rewards``.

    Raises:
        ValueError: unknown estimator, rewards not 1-D, shape mismatch, NaN/inf in ``rewards``,
            non-integer ``group_ids``, ``std_floor <= 0``.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(
            f"estimator={estimator!r} is not a group estimator; choose one of {GROUP_ESTIMATORS}"
        )
    if not std_floor > 0:
        raise ValueError(f"std_floor={std_floor} must be > 0")
    check_ndim("rewards", rewards, 1, "[N]")
    check_same_shape(rewards=rewards, group_ids=group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    check_finite("rewards", rewards)
    if rewards.numel() == 0:
        return rewards.clone()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    stats = _group_stats(rewards.double(), inverse, int(inverse.max()) + 1)
    singleton = stats.count == 1
    num_singletons = int(singleton.sum())
    if num_singletons:
        warnings.warn(
            f"group_advantages({estimator}): {num_singletons} group(s) with a single sample have no "
            "baseline; their advantages are set to 0",
            stacklevel=2,
        )
    adv = _ESTIMATORS[estimator](stats, std_floor)
    return torch.where(singleton, torch.zeros_like(adv), adv).to(rewards.dtype)


def is_group_informative(rewards: Sequence[float] | torch.Tensor) -> bool:
    """DAPO dynamic sampling predicate: True when a group's rewards are not all equal.

    A group whose rewards are all equal has zero group-relative advantage and no policy gradient;
    DAPO (Yu et al. 2025, eq. 11, the constraint ``0 < |{o_i : is_equivalent(a, o_i)}| < G``) drops
    such groups and samples more. The runtime applies this predicate when a group enters the buffer.
    Equality is exact on the given values (eight float32 rewards of 0.35 are equal).

    Raises:
        ValueError: an empty group or a NaN/inf reward.
    """
    values = torch.as_tensor(rewards).reshape(-1)
    if values.numel() == 0:
        raise ValueError("rewards of a group must not be empty")
    check_finite("rewards", values)
    return bool((values != values[0]).any())
