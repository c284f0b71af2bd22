"""How a learned reward model's score joins a task's verifiable reward: pure functions of tensors.

Shape legend: G groups, N samples per group. ``verifiable_GN`` are the task's rewards (verifier,
``reward_fn`` or environment), ``score_GN`` the reward model's raw scores, both float32.

Normalizations of the score (``NORMALIZATIONS``, ``reward.normalize``), applied before the combine:

- ``none``: the raw score.
- ``group``: ``(s - mean_g) / (std_g + eps)`` over the N samples of each group: the group-normalized
  outcome reward of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, sec. 4.1.2), applied to the
  score alone so that its scale does not swamp the verifiable reward; a group whose scores are all equal
  gets 0.
- ``batch``: ``(s - mean) / (std + eps)`` over every sample scored together (one delivery of groups):
  the reward model normalized to mean 0 and variance 1, as Ziegler et al. 2019 (arXiv:1909.08593,
  sec. 2.2) normalize theirs before RL and OpenRLHF's ``normalize_reward`` does with running moments.

Combines (``COMBINES``, ``reward.combine``):

- ``sum``: ``task_weight * verifiable + model_weight * normalized score`` (a weighted sum, as verl's and
  NeMo-RL's reward managers add a model score to rule-based rewards).
- ``model``: ``model_weight * normalized score``, the verifiable reward ignored (it is still recorded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS = 1e-6
"""Added to a standard deviation before dividing by it."""


def _none(score_GN: torch.Tensor) -> torch.Tensor:
    return score_GN


def _group(score_GN: torch.Tensor) -> torch.Tensor:
    mean = score_GN.mean(dim=1, keepdim=True)
    std = score_GN.std(dim=1, unbiased=False, keepdim=True)
    return (score_GN - mean) / (std + EPS)


def _batch(score_GN: torch.Tensor) -> torch.Tensor:
    return (score_GN - score_GN.mean()) / (score_GN.std(unbiased=False) + EPS)


NORMALIZATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": _none,
    "group": _group,
    "batch": _batch,
}
"""``reward.normalize`` name -> ``f(score_GN) -> normalized score_GN`` (module docstring)."""


def _weighted_sum(verifiable_GN, score_GN, task_weight: float, model_weight: float) -> torch.Tensor:
    return task_weight * verifiable_GN + model_weight * score_GN


def _model_only(verifiable_GN, score_GN, task_weight: float, model_weight: float) -> torch.Tensor:
    return model_weight * score_GN


COMBINES: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]] = {
    "sum": _weighted_sum,
    "model": _model_only,
}
"""``reward.combine`` name -> ``f(verifiable_GN, normalized score_GN, task_weight, model_weight)``."""


def mix_rewards(
    verifiable_GN: torch.Tensor,
    score_GN: torch.Tensor,
    *,
    combine: str,
    normalize: str,
    task_weight: float = 1.0,
    model_weight: float = 1.0,
) -> torch.Tensor:
    """The rewards [G, N] float32 that train: ``COMBINES[combine]`` of the verifiable rewards and the
    score under ``NORMALIZATIONS[normalize]`` (module docstring).

    Raises:
        ValueError: the shapes differ or are not 2-D, or an unknown ``combine`` / ``normalize`` name.
    """
    if verifiable_GN.shape != score_GN.shape or verifiable_GN.dim() != 2:
        raise ValueError(
            f"verifiable rewards {tuple(verifiable_GN.shape)} and scores {tuple(score_GN.shape)} must be "
            "the same [G, N] shape"
        )
    if combine not in COMBINES or normalize not in NORMALIZATIONS:
        raise ValueError(
            f"combine={combine!r} / normalize={normalize!r}: choose from {list(COMBINES)} / {list(NORMALIZATIONS)}"
        )
    norm = NORMALIZATIONS[normalize](score_GN.float())
    return COMBINES[combine](verifiable_GN.float(), norm, task_weight, model_weight)
