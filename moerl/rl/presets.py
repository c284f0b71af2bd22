"""Loss presets: each named algorithm is one frozen ``LossPreset`` record in ``PRESETS``.

A preset is data, not code: ``policy_loss`` reads its fields (ratio level, surrogate, clip bounds,
aggregation, mismatch correction) and never branches on the preset's name. ``resolve_preset``
applies user overrides (for example from ``AlgorithmConfig``) on top of a named preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moerl.rl.advantages import GROUP_ESTIMATORS
from moerl.rl.aggregate import AGGREGATION_MODES
from moerl.rl.surrogates import SURROGATES

if TYPE_CHECKING:
    from moerl.config import AlgorithmConfig

RATIO_LEVELS = ("token", "sequence")
"""Where the ratio (and the mismatch weight) is taken: per token, or per sequence (GSPO)."""
ESTIMATORS = (*GROUP_ESTIMATORS, "gae")
"""Advantage estimators: the group ones (``group_advantages``) and gae (a value head)."""
MISMATCH_MODES = ("none", "truncate", "mask", "icepop")
"""Train/rollout mismatch corrections (``LossPreset.mismatch_mode``, ``moerl.rl.mismatch``)."""
ICEPOP_CAP = 5.0
"""IcePop's upper bound beta (Ling Team 2025, arXiv:2510.18855, Sec. 3.1: [alpha, beta] = [0.5, 5])."""


@dataclass(frozen=True, slots=True)
class LossPreset:
    """The full specification of one policy objective."""

    name: str
    """Preset name (``PRESETS`` key, or the base name after overrides)."""
    surrogate: str = "ppo_clip"
    """``ppo_clip``: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (Schulman et al. 2017, eq. 7);
    ``cispo``: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi (MiniMax-M1 2025, eq. 4-5)."""
    ratio_level: str = "token"
    """``token``: r_t = pi(y_t) / pi_old(y_t); ``sequence``: GSPO's length-normalized sequence ratio
    s = exp(mean_t log r_t), applied to every token in its token-level form (Zheng et al. 2025)."""
    eps_low: float = 0.2
    """Lower clip offset: the ratio is clipped from below at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip offset: the ratio is clipped from above at 1 + eps_high (clip-higher: > eps_low)."""
    dual_clip_c: float | None = None
    """Dual clip: where A < 0 the per-token loss is capped at -c A, c > 1 (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL", Sec. 3.3); ``None`` disables it."""
    aggregation: str = "seq-mean-token-mean"
    """Loss aggregation mode (``moerl.rl.aggregate``)."""
    estimator: str = "grpo"
    """Advantage estimator that goes with the preset: grpo, dr_grpo, rloo (``group_advantages``) or
    gae (``gae_advantages`` with a value head)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal at buffer admission (DAPO, ``is_group_informative``)."""
    mismatch_mode: str = "truncate"
    """Train/rollout mismatch correction with behaviour log-probs: ``none``, ``truncate`` (truncated
    IS, weight min(rho, cap); Yao et al. 2025), ``mask`` (masked IS: drop tokens, or whole sequences at
    sequence level, with rho outside [cap_low, cap]; Liu et al. 2025) or ``icepop`` (token-level
    two-sided mask, IcePop, Ling Team 2025; token level only). rho = pi_old / pi_behav. Without behaviour
    log-probs no correction is applied. Default ``truncate`` at token level with C = 2: it keeps every
    token (no sample is lost when the engine and trainer agree, as on CPU) and bounds the weight of
    the tokens the trainer finds likelier than the engine did, which is Yao et al.'s recommendation."""
    mismatch_level: str = "token"
    """``token``: one rho per token; ``sequence``: the geometric mean of the sequence's token rhos."""
    mismatch_cap: float = 2.0
    """Truncation cap C (``truncate``) or upper bound C_high (``mask``), >= 1."""
    mismatch_cap_low: float = 0.5
    """Lower bound C_low of ``mask`` and ``icepop`` modes, in [0, 1]."""
    allows_kl: bool = True
    """Whether a KL penalty to a reference policy may be added (``kl_coef > 0``); DAPO removes it."""

    def __post_init__(self) -> None:
        choices = {
            "surrogate": SURROGATES,
            "ratio_level": RATIO_LEVELS,
            "aggregation": AGGREGATION_MODES,
            "estimator": ESTIMATORS,
            "mismatch_mode": MISMATCH_MODES,
            "mismatch_level": RATIO_LEVELS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{self.name}: {name}={getattr(self, name)!r}; choose one of {list(allowed)}"
                )
        if not 0.0 <= self.eps_low <= 1.0:
            raise ValueError(f"{self.name}: eps_low={self.eps_low} must be in [0, 1]")
        if not self.eps_high >= 0.0:
            raise ValueError(f"{self.name}: eps_high={self.eps_high} must be >= 0")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"{self.name}: dual_clip_c={self.dual_clip_c} must be > 1 (or None)")
        if not self.mismatch_cap >= 1.0:
            raise ValueError(f"{self.name}: mismatch_cap={self.mismatch_cap} must be >= 1")
        if not 0.0 <= self.mismatch_cap_low <= 1.0:
            raise ValueError(f"{self.name}: mismatch_cap_low={self.mismatch_cap_low} must be in [0, 1]")
        if self.mismatch_mode == "icepop" and self.mismatch_level != "token":
            raise ValueError(
                f"{self.name}: mismatch_mode='icepop' is token-level; set mismatch_level='token'"
            )


PRESETS: dict[str, LossPreset] = {
    # Shao et al. 2024, DeepSeekMath, eq. 3: per-sequence token mean, symmetric clip, group-normalized A.
    "grpo": LossPreset(name="grpo"),
    # Liu et al. 2025, Dr. GRPO, Sec. 3.1: no 1/|o_i| and no std normalization.
    "dr_grpo": LossPreset(name="dr_grpo", aggregation="seq-mean-token-sum-norm", estimator="dr_grpo"),
    # Yu et al. 2025, DAPO, eq. 8-11 and Sec. 3.1-3.3: clip-higher (0.2, 0.28), token-level loss,
    # dynamic sampling; Sec. 2.3 removes the KL penalty.
    "dapo": LossPreset(
        name="dapo", eps_high=0.28, aggregation="token-mean", dynamic_sampling=True, allows_kl=False
    ),
    # Zheng et al. 2025, GSPO, Sec. 4 (sequence ratio, GSPO-token form) and Sec. 5 (clip 3e-4, 4e-4).
    "gspo": LossPreset(name="gspo", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
    # MiniMax-M1 2025, eq. 4-5: clipped stop-gradient IS weight, token-level mean; no lower bound
    # (eps_low = 1) and an upper bound of 5 (eps_high = 4), as in ScaleRL (Khatri et al. 2025).
    "cispo": LossPreset(name="cispo", surrogate="cispo", eps_low=1.0, eps_high=4.0, aggregation="token-mean"),
    # Schulman et al. 2017, PPO, eq. 7 with GAE advantages (Schulman et al. 2016), token mean.
    "ppo": LossPreset(name="ppo", aggregation="token-mean", estimator="gae"),
}
"""Named presets; the comment above each entry gives its source."""


def resolve_preset(preset: str | LossPreset, **overrides: object) -> LossPreset:
    """The named (or given) preset with the non-``None`` ``overrides`` replacing its fields.

    Raises:
        ValueError: unknown preset name, unknown field, or an override the preset validation refuses.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    fields = {f.name for f in dataclasses.fields(LossPreset)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LossPreset field(s) {unknown}; fields: {sorted(fields)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(preset, **given) if given else preset


def preset_from_config(cfg: AlgorithmConfig) -> LossPreset:
    """The ``LossPreset`` selected by a ``moerl.config.AlgorithmConfig``: its ``preset`` with every
    field that is not ``None`` in the config replacing the preset's default."""
    return resolve_preset(
        cfg.preset,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        dual_clip_c=cfg.dual_clip_c,
        aggregation=cfg.aggregation,
        estimator=cfg.estimator,
        dynamic_sampling=cfg.dynamic_sampling,
        mismatch_mode=cfg.mismatch_mode,
        mismatch_level=cfg.mismatch_level,
        mismatch_cap=(
            cfg.mismatch_cap if cfg.mismatch_cap is not None or cfg.mismatch_mode != "icepop" else ICEPOP_CAP
        ),
        mismatch_cap_low=cfg.mismatch_cap_low,
    )
