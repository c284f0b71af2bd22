"""RL objectives: pure functions of tensors for advantages, policy losses, KL and aggregation.

Shapes: B sequences, T positions, V vocabulary, N samples. Per-token tensors are [B, T] and aligned
with the tokens (see ``moerl.rl.logprobs`` for the alignment and temperature conventions).

Public API:

- ``group_advantages(rewards [N], group_ids [N], *, estimator="grpo" | "dr_grpo" | "rloo",
  std_floor=1e-6) -> [N]``
- ``is_group_informative(rewards) -> bool`` (DAPO dynamic sampling predicate)
- ``token_rewards(scores [B], mask [B, T], *, kl=None, kl_coef=0.0) -> [B, T]``
- ``gae_advantages(rewards [B, T], values [B, T], mask [B, T], *, gamma=1.0, lam=0.95)
  -> (advantages [B, T], returns [B, T])``
- ``value_loss(values, old_values, returns, *, clip_eps=0.2) -> [B, T]``
- ``kl_estimate(logp, ref_logp, kind="k1" | "k2" | "k3") -> same shape``
- ``aggregate(values [B, T], mask [B, T], mode="token-mean" | "seq-mean-token-mean" |
  "seq-mean-token-sum" | "seq-mean-token-sum-norm", *, num_tokens=None, num_seqs=None,
  norm_length=None) -> scalar``
- ``policy_loss(logp, old_logp, advantages, mask, *, preset="grpo", behav_logp=None, ref_logp=None,
  kl_coef=0.0, kl_kind="k3", entropy=None, entropy_coef=0.0, num_tokens=None, num_seqs=None,
  norm_length=None) -> (loss, metrics: dict[str, float])``
- ``mismatch_weights(old_logp, behav_logp, mask, preset) -> MismatchWeights`` and
  ``rollout_mismatch_sums(train_logp, behav_logp, mask) -> [2]`` (|diff| and k3 sums)
- ``whiten(x [B, T], mask) -> [B, T]``, ``explained_variance(values, returns, mask) -> float``
- ``token_logprobs(logits [B, T, V], labels [B, T], temperature=1.0) -> [B, T]`` and
  ``entropy_from_logits(logits [B, T, V], labels [B, T], ignore_index=-100) -> [B, T]``
- ``LossPreset``, ``PRESETS``, ``resolve_preset(preset, **overrides)``,
  ``preset_from_config(AlgorithmConfig) -> LossPreset``
"""

from moerl.rl.advantages import GROUP_ESTIMATORS, group_advantages, is_group_informative
from moerl.rl.aggregate import AGGREGATION_MODES, aggregate
from moerl.rl.gae import explained_variance, gae_advantages, token_rewards, value_loss, whiten
from moerl.rl.kl import KL_ESTIMATORS, kl_estimate
from moerl.rl.logprobs import entropy_from_logits, token_logprobs
from moerl.rl.losses import policy_loss
from moerl.rl.mismatch import MismatchWeights, mismatch_weights, rollout_mismatch_sums
from moerl.rl.presets import PRESETS, LossPreset, preset_from_config, resolve_preset

__all__ = [
    "AGGREGATION_MODES",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "PRESETS",
    "LossPreset",
    "MismatchWeights",
    "aggregate",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "group_advantages",
    "is_group_informative",
    "kl_estimate",
    "mismatch_weights",
    "policy_loss",
    "preset_from_config",
    "resolve_preset",
    "rollout_mismatch_sums",
    "token_logprobs",
    "token_rewards",
    "value_loss",
    "whiten",
]
