"""Config of the RL objective (``algorithm:`` in a run config) and the checks of algorithm combinations
that ``RunConfig`` runs when it is loaded; re-exported by ``moerl.config``, which composes them."""

from __future__ import annotations

import json
import warnings
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.configlib import ConfigError, check_choice, check_range

if TYPE_CHECKING:
    from moerl.config import RunConfig


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The RL objective: advantage estimator, policy loss preset and its coefficients (moerl.rl).

    Fields left at ``None`` take the preset's value (``moerl.rl.PRESETS``); resolve the effective
    loss with ``moerl.rl.preset_from_config(cfg)``.
    """

    preset: str = "grpo"
    """Loss preset: grpo, dr_grpo, dapo, gspo, cispo, ppo."""
    estimator: str | None = None
    """Advantage estimator: grpo, dr_grpo, rloo (group-relative) or gae (value head); None: the preset's."""
    eps_low: float | None = None
    """Lower clip offset in [0, 1]: the ratio is clipped below at 1 - eps_low; None: the preset's."""
    eps_high: float | None = None
    """Upper clip offset >= 0 (clip-higher when > eps_low): clipped above at 1 + eps_high; None: the preset's."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1: where A < 0 the token loss is capped at -c A; None: the preset's (off)."""
    aggregation: str | None = None
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm; None: the preset's."""
    norm_length: int | None = None
    """Constant length (tokens) of seq-mean-token-sum-norm (Dr. GRPO); None: rollout.max_new_tokens."""
    mismatch_mode: str | None = None
    """Train/rollout mismatch correction from the engine's behaviour log-probs (``moerl.rl.mismatch``):
    none; truncate (TIS, Yao et al. 2025: weight min(rho, C)); mask (MIS, Liu et al. 2025: drop tokens or
    sequences with rho outside [C_low, C]); icepop (IcePop, Ling Team 2025: token-level two-sided mask
    with bounds [0.5, 5] unless mismatch_cap / mismatch_cap_low are set). None: the preset's (truncate,
    token, C=2)."""
    mismatch_level: str | None = None
    """Mismatch ratio level: token, or sequence (geometric mean over the sequence); None: the preset's (token)."""
    mismatch_cap: float | None = None
    """IS cap C >= 1 (truncate) or upper bound (mask, icepop); None: the preset's (2.0; icepop 5.0)."""
    mismatch_cap_low: float | None = None
    """Lower IS bound in [0, 1] of mask and icepop modes; None: the preset's (0.5)."""
    tis_mode: InitVar[str | None] = None
    """Former name of ``mismatch_mode`` (keyword only, not a YAML key)."""
    tis_level: InitVar[str | None] = None
    """Former name of ``mismatch_level``."""
    tis_cap: InitVar[float | None] = None
    """Former name of ``mismatch_cap``."""
    tis_cap_low: InitVar[float | None] = None
    """Former name of ``mismatch_cap_low``."""
    routing_replay: str = "off"
    """Rollout routing replay: ``off``, or ``r3`` (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning
    by Aligning Training and Inference Routers"): the engine records the experts it routed every token to
    (``rollout.return_routed_experts`` is switched on), and the trainer's forwards replay them
    (``MoeForCausalLM.forward(forced_experts=...)``), so that train and rollout log-probs come from the
    same experts. Off by default: on CPU the engine and the trainer run the same float32 model and
    kernels, so their expert choices already agree; see bench/README.md for the measured cost and gain."""
    kl_coef: float = 0.0
    """Coefficient beta of the KL penalty against a frozen reference policy (a copy of the policy the RL
    run starts from: the warm start or ``init_from``); 0 disables it and builds no reference model."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2, k3 (Schulman 2020, "Approximating KL divergence"; ``moerl.rl.kl_estimate``)."""
    kl_in_reward: bool = False
    """Fold the KL penalty into the reward instead of adding it to the loss: per token (estimator gae,
    Ziegler et al. 2019) or summed over the response and subtracted from the sequence reward before the
    group advantages (grpo, dr_grpo, rloo). The KL is then between the behaviour and reference log-probs."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop groups whose rewards are all equal at buffer admission; None: the preset's."""
    gae_gamma: float = 1.0
    """GAE discount gamma in [0, 1] (estimator gae)."""
    gae_lambda: float = 0.95
    """GAE lambda in [0, 1] (estimator gae)."""
    value_clip: float | None = 0.2
    """Value-loss clip range around the rollout-time values (estimator gae); None disables clipping."""
    value_coef: float = 0.5
    """Coefficient of the value loss (estimator gae)."""

    def __post_init__(self, tis_mode=None, tis_level=None, tis_cap=None, tis_cap_low=None) -> None:
        former = {"mode": tis_mode, "level": tis_level, "cap": tis_cap, "cap_low": tis_cap_low}
        for suffix, value in former.items():
            if value is not None:
                setattr(self, f"mismatch_{suffix}", value)
        # here, not at the top: moerl.rl loads torch, and this module must load without it (``moerl --help``)
        from moerl.rl.aggregate import AGGREGATION_MODES
        from moerl.rl.kl import KL_ESTIMATORS
        from moerl.rl.presets import ESTIMATORS, MISMATCH_MODES, PRESETS, RATIO_LEVELS

        check_choice("algorithm.preset", self.preset, PRESETS)
        check_choice("algorithm.kl_kind", self.kl_kind, KL_ESTIMATORS)
        check_choice("algorithm.routing_replay", self.routing_replay, ["off", "r3"])
        check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        choices = {
            "estimator": ESTIMATORS,
            "aggregation": AGGREGATION_MODES,
            "mismatch_mode": MISMATCH_MODES,
            "mismatch_level": RATIO_LEVELS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) is not None:
                check_choice(f"algorithm.{name}", getattr(self, name), allowed)
        ranges = {
            "eps_low": (0.0, 1.0),
            "eps_high": (0.0, None),
            "mismatch_cap": (1.0, None),
            "mismatch_cap_low": (0.0, 1.0),
            "norm_length": (1, None),
        }
        for name, (lo, hi) in ranges.items():
            if getattr(self, name) is not None:
                check_range(f"algorithm.{name}", getattr(self, name), lo, hi)
        if self.dual_clip_c is not None:
            check_range("algorithm.dual_clip_c", self.dual_clip_c, 1.0, lo_open=True)
        if self.value_clip is not None:
            check_range("algorithm.value_clip", self.value_clip, 0.0, lo_open=True)
        check_range("algorithm.gae_gamma", self.gae_gamma, 0.0, 1.0)
        check_range("algorithm.gae_lambda", self.gae_lambda, 0.0, 1.0)
        check_range("algorithm.value_coef", self.value_coef, 0.0)
        if self.kl_in_reward and self.kl_coef == 0.0:
            raise ConfigError("algorithm.kl_in_reward=True needs algorithm.kl_coef > 0")


def _model_family(cfg: RunConfig) -> str:
    """The policy's family: the ``model_type`` of the checkpoint RL starts from when it is a folder with a
    config.json (``init_from``, else ``model.path``), else ``model.family`` (the fresh or SFT model)."""
    for folder in (cfg.init_from, cfg.model.path):
        if folder is not None and (Path(folder) / "config.json").is_file():
            try:
                return str(json.loads((Path(folder) / "config.json").read_text()).get("model_type", ""))
            except (OSError, ValueError):
                return ""  # unreadable here: the model loader names the problem later
    return cfg.model.family


def check_algorithm_combination(cfg: RunConfig, preset) -> None:
    """Combinations of algorithm and trainer settings that cannot run, refused when the config is
    loaded (before any warm start). ``preset``: the resolved ``moerl.rl.LossPreset``.

    Raises:
        ConfigError: naming the settings and what to change.
    """
    from moerl.models.build import BIAS_FAMILIES  # here: moerl.models loads torch, this module must not

    alg, tr = cfg.algorithm, cfg.trainer
    if alg.kl_coef > 0 and not preset.allows_kl:
        raise ConfigError(
            f"algorithm.kl_coef={alg.kl_coef} with algorithm.preset={alg.preset!r}: that preset has no KL "
            "penalty (DAPO, Yu et al. 2025, Sec. 2.3, removes it); set algorithm.kl_coef=0 or another preset"
        )
    if tr.mini_batches > tr.batch_groups:
        raise ConfigError(
            f"trainer.mini_batches={tr.mini_batches} is more than trainer.batch_groups={tr.batch_groups}: "
            "each mini-batch needs at least one group"
        )
    updates = tr.ppo_epochs * tr.mini_batches
    if updates > 1 and preset.mismatch_mode != "none" and not tr.recompute_proximal:
        raise ConfigError(
            f"trainer.ppo_epochs={tr.ppo_epochs} x trainer.mini_batches={tr.mini_batches} optimizer steps per "
            f"batch with algorithm.mismatch_mode={preset.mismatch_mode!r}: after the first update the trainer's "
            "log-probs are no longer the proximal policy's; set trainer.recompute_proximal=true (one extra "
            "forward) or algorithm.mismatch_mode=none"
        )
    if cfg.rollout.weight_dtype == "fp8" and preset.mismatch_mode == "none":
        warnings.warn(
            "rollout.weight_dtype='fp8' with algorithm.mismatch_mode='none': the FP8 engine's log-probs "
            "differ from the trainer's, and nothing corrects for it (the default, truncate, does)",
            stacklevel=2,
        )
    if tr.bias_update_rate > 0 and _model_family(cfg) not in BIAS_FAMILIES:
        raise ConfigError(
            f"trainer.bias_update_rate={tr.bias_update_rate} needs routers with an e_score_correction_bias "
            f"(model families {list(BIAS_FAMILIES)}); this model is {_model_family(cfg)!r}: set "
            "trainer.bias_update_rate=0 or use trainer.aux_loss_coef"
        )


def check_group_samples(cfg: RunConfig, estimator: str) -> None:
    """A group-relative estimator (GRPO, Dr. GRPO, RLOO: every preset but ``ppo``, whose critic gives the
    baseline) needs groups whose samples can differ: at least 2 samples a prompt, drawn by sampling, not
    greedy decoding (``rollout.temperature=0`` or ``rollout.top_k=1``: every sample of a prompt is the same
    response). An episode task (``task.name=env``) is exempt from the greedy check: its environment may
    answer the samples of a group differently. A tiny ``rollout.top_p`` is not refused: whether it keeps
    only the most likely token depends on the policy's distribution.

    Raises:
        ConfigError: naming the field, the estimator and why every advantage would be 0.
    """
    from moerl.rl.advantages import GROUP_ESTIMATORS  # the baseline is the other samples of the group

    if estimator not in GROUP_ESTIMATORS:
        return
    r = cfg.rollout
    if r.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={r.group_size}: the {estimator} estimator compares samples "
            "of one prompt, so a group needs at least 2 (every advantage would be 0)"
        )
    greedy = f"rollout.temperature={r.temperature}" if r.temperature == 0 else "rollout.top_k=1"
    if (r.temperature == 0 or r.top_k == 1) and cfg.task.name != "env":
        raise ConfigError(
            f"{greedy} decodes greedily: the {r.group_size} samples of a group are the same response, so "
            f"the {estimator} estimator's group-relative advantages are all 0 and nothing is trained; sample "
            "with rollout.temperature > 0 and rollout.top_k != 1 (or use algorithm.preset=ppo, whose critic "
            "gives the baseline)"
        )
