"""PPO's critic: a value model, GAE advantages and the clipped value loss (estimator ``gae``).

The value model is a copy of the policy's trunk (embeddings, decoder layers, final norm) with the LM head
replaced by a linear value head ``[H] -> 1`` (``ValueHead``) that starts at zero (so V = 0 at first).
Why a copy of the trunk and not a separate small model: the warm-started trunk already encodes the task
(what the prompt asks, how far the answer has got), so the value head learns from useful features from
the first step;
why a copy and not a head on the policy's own trunk: the value loss then never moves the policy's
weights, and the policy's optimizer, publishing and weight versions stay exactly as without a critic.
It costs a second model's memory and one forward + backward per update.

Values and positions: ``V_t`` is the value of the state before token t, read from the trunk's output at
position t - 1 (the same position whose logits predict token t), so values are aligned with the tokens
like every other [B, T] tensor of the batch.

Sharding: on a sharded trainer (``trainer.num_ranks > 1``) the value model is built sharded like the
policy (FSDP2 x EP, ``moerl.trainer.distributed.algo_models.build_value_model``) and passed in; its loss uses the
step's global token count (FSDP2 sums the gradients), its gradient norm is the global one
(``clip_grad_norm``), and the advantage whitening and explained variance in ``gae_targets`` are over the
global batch: their sums and counts go through ``reduce`` (an all-reduce over the ranks).

Shapes: B sequences, T tokens, H hidden size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.rl import aggregate, gae_advantages, kl_estimate, token_rewards, value_loss

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum of a CPU float64 tensor over the data-parallel ranks (the identity at one rank)."""


class Critic:
    """The value model with its own AdamW optimizer and LR schedule.

    Args:
        policy: the policy at the start of RL (``moerl.models.MoeForCausalLM``); its trunk is copied.
        cfg: the trainer config (``critic_lr``, ``weight_decay``, ``grad_clip``, warm-up and schedule).
        algorithm: ``value_clip`` and ``value_coef``.
        lr_lambda: the LR multiplier per optimizer step (``moerl.trainer.local.lr_factor``).
        value_model: a value model built elsewhere (a sharded trunk with its value head), used instead of a
            copy of ``policy``'s trunk.
        clip_grad_norm: ``(parameters, max_norm) -> norm before clipping``; default
            ``torch.nn.utils.clip_grad_norm_`` (a sharded trainer passes its global-norm clip).
    """

    def __init__(
        self,
        policy: nn.Module,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        lr_lambda,
        *,
        value_model: nn.Module | None = None,
        clip_grad_norm: Callable[[list, float], float] | None = None,
    ) -> None:
        model = with_value_head(copy.deepcopy(policy)) if value_model is None else value_model
        self.model = model
        self.algorithm = algorithm
        self.grad_clip = cfg.grad_clip
        self.clip_grad_norm = clip_grad_norm or (
            lambda params, max_norm: float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        )
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
        norm = self.clip_grad_norm(list(self.model.parameters()), max_norm)
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


class ValueHead(nn.Module):
    """PPO's linear value head: h [..., H] -> V [..., 1] = h w^T + b, with ``weight`` [1, H] and ``bias`` [1]
    (the state-dict names and shapes of ``nn.Linear(H, 1)``).

    Computed as a matmul followed by an out-of-place add, not ``F.linear``: with a bias and a 3-D input,
    ``F.linear`` fuses the bias into an ``addmm`` on the flattened rows and returns a *view* of that
    result, and the sharded value model (FSDP2's root module) would then return a view, which FSDP2
    warns about (an in-place op on it would skip the pre-backward all-gather). Here the output owns its
    storage; the values equal ``F.linear``'s up to float rounding of the bias add.
    """

    def __init__(self, hidden_size: int, *, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., 1] in the head's dtype (a tensor of its own, not a view)."""
        return torch.matmul(h, self.weight.t()) + self.bias


def with_value_head(model: nn.Module) -> nn.Module:
    """``model`` (a ``MoeForCausalLM``) with its LM head replaced, in place, by a zero-initialized
    ``ValueHead`` ``[H] -> 1`` (weight and bias 0: V = 0 at first) in the model's dtype."""
    w = model.lm_head.weight
    model.lm_head = ValueHead(model.lm_head.in_features, device=w.device, dtype=w.dtype)
    return model


@torch.no_grad()
def masked_mean_var(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None) -> tuple[float, float]:
    """Mean and population variance of ``x`` [B, T] over the ``mask`` [B, T] entries of every rank's rows
    (two ``reduce`` calls: count and sum, then the squared deviations from the global mean), in float64.

    Returns:
        ``(mean, var)``; ``(nan, nan)`` when no entry is masked in anywhere.
    """
    reduce = reduce or (lambda t: t)
    v = x[mask.bool()].double().cpu()
    n, total = reduce(torch.tensor([float(v.numel()), float(v.sum())], dtype=torch.float64)).tolist()
    if n == 0:  # n is global: every rank returns here, so all make the same collectives
        return float("nan"), float("nan")
    mean = total / n
    sq = reduce((v - mean).square().sum().reshape(1).to(torch.float64))
    return mean, float(sq[0]) / n


@torch.no_grad()
def global_whiten(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None, *, eps: float = 1e-8):
    """``moerl.rl.whiten`` over every rank's rows: ``(x - mean) / (std + eps)`` at the masked-in entries,
    0 elsewhere, with the global mean and population std (``masked_mean_var``); all zeros when no entry
    is masked in anywhere. x [B, T] float, mask [B, T] bool; returns [B, T] in x's dtype."""
    mask = mask.bool()
    mean, var = masked_mean_var(x, mask, reduce)
    if math.isnan(mean):
        return torch.zeros_like(x)
    return torch.where(mask, (x - mean) / (math.sqrt(var) + eps), torch.zeros((), dtype=x.dtype))


@torch.no_grad()
def global_explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> float:
    """``moerl.rl.explained_variance`` (``1 - Var[returns - values] / Var[returns]``, OpenAI Baselines) over
    every rank's masked-in entries; NaN when there is none or Var[returns] is 0."""
    mask = mask.bool()
    _, var_r = masked_mean_var(returns, mask, reduce)
    _, var_d = masked_mean_var(returns.double() - values.double(), mask, reduce)
    if math.isnan(var_r) or var_r == 0.0:
        return float("nan")
    return 1.0 - var_d / var_r


def gae_targets(
    rewards: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    algorithm: AlgorithmConfig,
    *,
    behav_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-token advantages (whitened over the batch), value targets and the critic's explained variance.

    Rewards per token (``moerl.rl.token_rewards``): the sequence reward at its last response token, minus
    ``kl_coef * KL_t`` at every token when ``algorithm.kl_in_reward`` (KL of behaviour vs reference
    log-probs). Then GAE (Schulman et al. 2016, eq. 16; ``moerl.rl.gae_advantages``) with
    ``gae_gamma`` / ``gae_lambda``, and the whitening of the advantages (``global_whiten``).

    Args:
        rewards: [B] float32. old_values: [B, T] float32 critic values at the step's start.
        mask: [B, T] bool response tokens. behav_logp, ref_logp: [B, T], needed for ``kl_in_reward``.
        reduce: sum over the data-parallel ranks (whitening and explained variance over the global batch);
            None: this batch is the whole batch.

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
    ev = global_explained_variance(old_values, returns, mask, reduce)
    return global_whiten(adv, mask, reduce), returns, ev
