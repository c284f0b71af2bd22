"""PPO's critic: a value model, GAE advantages and the clipped value loss (estimator ``gae``).

The value model is a copy of the policy's trunk (embeddings, decoder layers, final norm) with the LM head
replaced by a linear value head ``[H] -> 1`` that starts at zero (so V = 0 at first). Why a copy of the
trunk and not a separate small model: the warm-started trunk already encodes the task (what the prompt
asks, how far the answer has got), so the value head learns from useful features from the first step;
why a copy and not a head on the policy's own trunk: the value loss then never moves the policy's
weights, and the policy's optimizer, publishing and weight versions stay exactly as without a critic.
It costs a second model's memory and one forward + backward per update.

Values and positions: ``V_t`` is the value of the state before token t, read from the trunk's output at
position t - 1 (the same position whose logits predict token t), so values are aligned with the tokens
like every other [B, T] tensor of the batch.

Sharding: on a sharded trainer (``trainer.num_ranks > 1``) the critic must be sharded like the policy;
its loss uses the step's global token count, and ``whiten`` / ``explained_variance`` here are over the
local rows (the coordinator must all-reduce their sums for an exact multi-rank match).

Shapes: B sequences, T tokens, H hidden size.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.rl import (
    aggregate,
    explained_variance,
    gae_advantages,
    kl_estimate,
    token_rewards,
    value_loss,
    whiten,
)


class Critic:
    """The value model with its own AdamW optimizer and LR schedule.

    Args:
        policy: the policy at the start of RL (``moerl.models.MoeForCausalLM``); its trunk is copied.
        cfg: the trainer config (``critic_lr``, ``weight_decay``, ``grad_clip``, warm-up and schedule).
        algorithm: ``value_clip`` and ``value_coef``.
        lr_lambda: the LR multiplier per optimizer step (``moerl.runtime.trainer.lr_factor``).
    """

    def __init__(self, policy: nn.Module, cfg: TrainerConfig, algorithm: AlgorithmConfig, lr_lambda) -> None:
        model = copy.deepcopy(policy)
        hidden = model.lm_head.in_features
        model.lm_head = nn.Linear(hidden, 1, bias=True, device=model.lm_head.weight.device)
        nn.init.zeros_(model.lm_head.weight)
        nn.init.zeros_(model.lm_head.bias)
        model.lm_head.to(next(policy.parameters()).dtype)
        self.model = model
        self.algorithm = algorithm
        self.grad_clip = cfg.grad_clip
        lr = cfg.critic_lr if cfg.critic_lr is not None else 10 * cfg.lr
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """V_t [B, T] float32 for ``input_ids`` [B, T] (position 0: 0); with gradient when enabled."""
        out = self.model(input_ids, attention_mask).logits[..., 0].float()  # (B, T): value after token t
        return torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)

    def loss(self, mb, *, num_tokens: int) -> tuple[torch.Tensor, float]:
        """``value_coef x`` the token-mean clipped value loss of micro-batch ``mb`` (a ``TrainBatch`` with
        ``old_values`` and ``returns``) over the step's ``num_tokens``; returns (loss with gradient, the
        unscaled loss value). Source: ``moerl.rl.value_loss`` (PPO eq. 9 with value clipping)."""
        dev = next(self.model.parameters()).device
        mask = mb.loss_mask.to(dev)
        v = self.values(mb.input_ids.to(dev), mb.attention_mask.to(dev))
        per_token = value_loss(
            v, mb.old_values.to(dev), mb.returns.to(dev), clip_eps=self.algorithm.value_clip
        )
        loss = aggregate(per_token, mask, "token-mean", num_tokens=num_tokens)
        return self.algorithm.value_coef * loss, float(loss.detach())

    def step(self) -> float:
        """Clip the critic's gradient norm, AdamW step, zero the gradients; returns the norm (NaN: skipped)."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        """Checkpoint parts: value model, optimizer, scheduler."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` parts."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def gae_targets(
    rewards: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    algorithm: AlgorithmConfig,
    *,
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-token advantages (whitened over the batch), value targets and the critic's explained variance.

    Rewards per token (``moerl.rl.token_rewards``): the sequence reward at its last response token, minus
    ``kl_coef * KL_t`` at every token when ``algorithm.kl_in_reward`` (KL of behaviour vs reference
    log-probs). Then GAE (Schulman et al. 2016, eq. 16; ``moerl.rl.gae_advantages``) with
    ``gae_gamma`` / ``gae_lambda``, and ``moerl.rl.whiten`` of the advantages.

    Args:
        rewards: [B] float32. old_values: [B, T] float32 critic values at the step's start.
        mask: [B, T] bool response tokens. behav_logp, ref_logp: [B, T], needed for ``kl_in_reward``.

    Returns:
        ``(advantages [B, T], returns [B, T], explained variance of old_values for returns)``.
    """
    kl = None
    if algorithm.kl_in_reward:
        kl = kl_estimate(behav_logp.float(), ref_logp.float(), algorithm.kl_kind)
    token_r = token_rewards(rewards.to(old_values.dtype), mask, kl=kl, kl_coef=algorithm.kl_coef)
    adv, returns = gae_advantages(
        token_r, old_values, mask, gamma=algorithm.gae_gamma, lam=algorithm.gae_lambda
    )
    return whiten(adv, mask), returns, explained_variance(old_values, returns, mask)
