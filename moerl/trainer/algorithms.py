"""The algorithm parts of a trainer step beyond the policy loss: routing replay, mismatch correction
inputs, the reference policy's KL, the critic, and router load balancing.

``Trainer`` owns one ``AlgoParts`` and calls it at fixed points of ``train_step``:

    prepare(batch)        no grad, before any update: proximal log-probs (trainer.recompute_proximal),
                          reference log-probs (kl_coef > 0), KL folded into the advantages
                          (kl_in_reward), critic values -> GAE advantages and returns (estimator gae)
    forced_experts(mb)    the engine's experts to replay in a forward (routing_replay=r3)
    loss_inputs(mb)       old / behaviour / reference log-probs and KL coefficient for policy_loss
    critic_loss(mb)       value_coef x clipped value loss, added to the policy loss (separate parameters)
    observe(...)          per micro-batch metrics: IS weights, train/rollout gap, KL, expert loads
    critic_step()         the critic's optimizer step after the policy's
    end_step()            once per trainer step: critic LR schedule, correction-bias update
    stats(batch)          the step's ``AlgoStats``

Mismatch correction (``moerl.rl.mismatch``) needs no extra forward: with one update per step and
``recompute_proximal`` off, pi_old is the policy at the step's start, which is what the training forward
computes; ``policy_loss`` gets ``old_logp=None`` (ratio 1, the detached current log-probs) and the
engine's log-probs as ``behav_logp``. With several updates per step the proximal log-probs are recomputed
(``recompute_proximal``) or, with ``mismatch_mode=none``, the engine's log-probs are the PPO ``old`` (the
config refuses the other combinations).

Sharded trainer (``trainer.num_ranks > 1``, ``moerl.trainer.distributed.ShardedTrainer``): the per-token math
runs on the rank's rows with the trainer's global normalizers; what needs the whole batch goes through
``reduce`` (a sum over the data-parallel ranks, one ``all_reduce`` each; the identity at one rank): the
advantage whitening and the explained variance (``moerl.trainer.critic.gae_targets``), and in ``stats``
every figure's sums and token counts and the per-expert token counts (also those of the bias update).
So the logged figures are the global batch's at any rank count. The reference policy and the critic
given to ``build`` are then sharded like the policy (``moerl.trainer.distributed.algo_models``).

Shapes: B sequences, T tokens, L_moe MoE layers, k top-k, E experts per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as dc_replace

import torch

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.models.build import BIAS_FAMILIES
from moerl.models.moe import update_correction_bias
from moerl.rl import rollout_mismatch_sums
from moerl.rl.presets import LossPreset
from moerl.trainer.batch import TrainBatch
from moerl.trainer.critic import Critic, gae_targets, masked_mean_var
from moerl.trainer.reference import ReferencePolicy, kl_penalized_group_advantages

NAN = float("nan")


@dataclass(frozen=True, slots=True)
class AlgoStats:
    """The step's algorithm figures; NaN where the step did not measure them (logged as null)."""

    is_weight_mean: float = NAN
    """Mean mismatch importance weight over loss tokens (``moerl.rl.mismatch``), mean over updates."""
    is_clipfrac: float = NAN
    """Fraction of loss tokens whose weight was truncated or masked."""
    rollout_logprob_abs_diff: float = NAN
    """Mean |trainer log-prob - engine log-prob| over the step's loss tokens (nats), trainer log-probs of
    the policy at the step's start (each mini-batch's first-epoch forward without recompute_proximal)."""
    rollout_kl: float = NAN
    """k3 estimate of KL(engine || trainer) per token over the same tokens (nats)."""
    kl_ref: float = NAN
    """Mean k-estimate (``algorithm.kl_kind``) of KL(policy || reference) over loss tokens (kl_coef > 0)."""
    value_loss: float = NAN
    """Clipped value loss (token mean, before value_coef), mean over updates (estimator gae)."""
    value_explained_var: float = NAN
    """Explained variance of the GAE returns by the critic's values at the step's start (estimator gae)."""
    value_loss_normalized: float = NAN
    """``value_loss`` / (0.5 Var[returns]) over the step's loss tokens (estimator gae): the value loss in
    units of the loss of a critic that predicts the batch's mean return (1), so it does not move with the
    reward variance as the raw loss does; about 1 - explained variance when the values are unbiased."""
    expert_load_max_min: float = NAN
    """Largest over MoE layers of (most tokens of an expert) / max(1, fewest tokens of an expert)."""
    expert_load_max_min_per_layer: tuple[float, ...] = ()
    """The same ratio for each MoE layer, in layer order."""


class AlgoParts:
    """Reference policy, critic and routing/balancing state of one trainer (built by ``build``)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        preset: LossPreset,
        *,
        reference: ReferencePolicy | None,
        critic: Critic | None,
        bias_blocks: list,
        num_experts: int,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.cfg, self.algorithm, self.preset = cfg, algorithm, preset
        self.reference, self.critic = reference, critic
        self.reduce = reduce if reduce is not None else (lambda t: t)
        self.bias_blocks = bias_blocks
        self.num_experts = num_experts
        self.is_replay = algorithm.routing_replay == "r3"
        self.num_updates = cfg.ppo_epochs * cfg.mini_batches
        self._reset()

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        preset: LossPreset,
        lr_lambda,
        *,
        start_policy: torch.nn.Module | None = None,
        reference_model: torch.nn.Module | None = None,
        value_model: torch.nn.Module | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        clip_grad_norm: Callable[[list, float], float] | None = None,
    ) -> AlgoParts:
        """The parts ``algorithm`` asks for, for the policy ``model``; the reference policy and the critic's
        trunk copy ``start_policy`` (the policy as RL started; default ``model``).

        A sharded trainer passes its own, already sharded ``reference_model`` (frozen here) and
        ``value_model`` (a trunk with a value head, ``moerl.trainer.distributed.algo_models``), used instead of
        copies of ``start_policy``; ``reduce`` sums a CPU float64 tensor over the data-parallel ranks and
        ``clip_grad_norm(parameters, max_norm)`` clips the critic's gradients by their global norm.

        Raises:
            ValueError: ``bias_update_rate > 0`` on a model whose routers have no correction bias.
        """
        start = model if start_policy is None else start_policy
        blocks = list(model.moe_blocks()) if hasattr(model, "moe_blocks") else []
        for block in blocks:
            block.aux_loss_level = cfg.aux_loss_level
        bias_blocks = [b for b in blocks if b.router.e_score_correction_bias is not None]
        if cfg.bias_update_rate > 0 and not bias_blocks:
            raise ValueError(
                "trainer.bias_update_rate > 0 needs routers with an e_score_correction_bias "
                f"({', '.join(BIAS_FAMILIES)})"
            )
        reference = critic = None
        if algorithm.kl_coef > 0:
            given = reference_model is not None
            reference = ReferencePolicy(reference_model if given else start, copy=not given)
        if preset.estimator == "gae":
            critic = Critic(
                start, cfg, algorithm, lr_lambda, value_model=value_model, clip_grad_norm=clip_grad_norm
            )
        return cls(
            cfg,
            algorithm,
            preset,
            reference=reference,
            critic=critic,
            bias_blocks=bias_blocks,
            num_experts=int(getattr(getattr(model, "config", None), "num_experts", 0) or 0),
            reduce=reduce,
        )

    def _reset(self) -> None:
        self._sums = dict.fromkeys(("is_weight_mean", "is_clipfrac", "kl_ref", "value_loss"), 0.0)
        self._seen: set[str] = set()
        self._rollout = torch.zeros(2, dtype=torch.float64)
        self._counts: torch.Tensor | None = None  # (L_moe, E) tokens per expert over the step
        self._explained_var = NAN
        self._return_var = NAN

    # -- before the updates --------------------------------------------------------------------

    def prepare(self, trainer, batch: TrainBatch) -> TrainBatch:
        """``batch`` with the per-token inputs of the updates filled in (no gradient; see the module
        docstring). ``trainer``: the ``Trainer``, for its no-grad forward."""
        self._reset()
        fields: dict[str, torch.Tensor] = {}
        if self.cfg.recompute_proximal:
            fields["proximal_logprobs"] = trainer.no_grad_logprobs(batch).cpu()
        if self.reference is not None:
            ref = trainer.no_grad_logprobs(batch, self.reference.model).cpu()
            fields["ref_logprobs"] = ref
            if self.algorithm.kl_in_reward and self.critic is None:
                fields["advantages"] = kl_penalized_group_advantages(
                    batch.rewards,
                    batch.group_ids,
                    batch.behaviour_logprobs,
                    ref,
                    batch.loss_mask,
                    kl_coef=self.algorithm.kl_coef,
                    kl_kind=self.algorithm.kl_kind,
                    estimator=self.preset.estimator,
                )
        if self.critic is not None:
            old_values = self._critic_values(batch, trainer.device)
            adv, returns, self._explained_var = gae_targets(
                batch.rewards,
                old_values,
                batch.loss_mask,
                self.algorithm,
                behav_logp=batch.behaviour_logprobs,
                ref_logp=fields.get("ref_logprobs"),
                reduce=self.reduce,
            )
            self._return_var = masked_mean_var(returns, batch.loss_mask, self.reduce)[1]
            fields.update(advantages=adv, old_values=old_values, returns=returns)
        return dc_replace(batch, **fields) if fields else batch

    @torch.no_grad()
    def _critic_values(self, batch: TrainBatch, device: torch.device) -> torch.Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        row = 0
        for mb in batch.micro_batches(self.cfg.micro_batch_size):
            v = self.critic.values(mb.input_ids.to(device), mb.attention_mask.to(device)).cpu()
            out[row : row + v.shape[0], : v.shape[1]] = v
            row += v.shape[0]
        return out

    # -- inside an update ----------------------------------------------------------------------

    def forced_experts(self, mb: TrainBatch, device: torch.device) -> torch.Tensor | None:
        """[B, T, L_moe, k] experts to replay in ``mb``'s forward (R3), or None when replay is off.

        Raises:
            ValueError: replay is on and the batch carries no recorded experts.
        """
        if not self.is_replay:
            return None
        if mb.routed_experts is None:
            raise ValueError(
                "algorithm.routing_replay='r3' but the batch has no routed_experts: every sample must come "
                "from an engine recording them (rollout.return_routed_experts)"
            )
        return mb.routed_experts.to(device)

    def load_mask(self, mb: TrainBatch) -> torch.Tensor:
        """[B, T] bool: the tokens whose experts count in the load figures. Under replay the routed
        experts are the engine's, which never fed a row's last token (``TrainBatch.routed_experts``
        fills it with 0..k-1): that token is left out."""
        mask = mb.attention_mask.bool()
        if self.is_replay:
            mask = mask.clone()
            mask[torch.arange(mask.shape[0]), (mask.sum(dim=1) - 1).clamp_min(0)] = False
        return mask

    def loss_inputs(self, mb: TrainBatch, device: torch.device, *, is_single_update: bool) -> dict:
        """Keyword arguments of ``moerl.rl.policy_loss`` besides logp / advantages / mask / normalizers."""
        behav = mb.behaviour_logprobs.to(device)
        if mb.proximal_logprobs is not None:
            old, behav_in = mb.proximal_logprobs.to(device), behav
        elif is_single_update:
            old, behav_in = None, behav  # pi_old = the current weights (no update yet this step)
        else:
            old, behav_in = behav, None  # several updates, mismatch_mode none (the config enforces it)
        ref = None if mb.ref_logprobs is None else mb.ref_logprobs.to(device)
        in_loss = ref is not None and not self.algorithm.kl_in_reward
        return {
            "old_logp": old,
            "behav_logp": behav_in,
            "ref_logp": ref,
            "kl_coef": self.algorithm.kl_coef if in_loss else 0.0,
            "kl_kind": self.algorithm.kl_kind,
        }

    def critic_loss(self, mb: TrainBatch, num_tokens: int) -> torch.Tensor | float:
        """The critic's weighted value loss for ``mb`` (0.0 without a critic); records the unweighted one."""
        if self.critic is None:
            return 0.0
        loss, value = self.critic.loss(mb, num_tokens=max(num_tokens, 1))
        self._sums["value_loss"] += value / self.num_updates  # already a share of the mini-batch mean
        self._seen.add("value_loss")
        return loss

    @torch.no_grad()
    def observe(
        self,
        mb: TrainBatch,
        logp: torch.Tensor,
        routed: torch.Tensor | None,
        metrics: dict[str, float],
        tok_share: float,
        *,
        is_first_epoch: bool,
    ) -> None:
        """Accumulate one micro-batch's figures: ``metrics`` of ``policy_loss`` (weighted by its share
        ``tok_share`` of the mini-batch's tokens) and, in the first epoch, the train/rollout gap and the
        expert loads."""
        for key, name in (
            ("is_weight_mean", "is_weight_mean"),
            ("is_clipfrac", "is_clipfrac"),
            ("kl", "kl_ref"),
        ):
            if key in metrics:
                self._sums[name] += metrics[key] * tok_share / self.num_updates
                self._seen.add(name)
        if not is_first_epoch:
            return
        mask = mb.loss_mask.to(logp.device)
        train = mb.proximal_logprobs.to(logp.device) if mb.proximal_logprobs is not None else logp.detach()
        self._rollout += rollout_mismatch_sums(train, mb.behaviour_logprobs.to(logp.device), mask).cpu()
        if routed is not None and routed.shape[2] > 0 and self.num_experts > 0:
            picked = routed[self.load_mask(mb).to(routed.device)]  # (N, L_moe, k)
            flat = picked.permute(1, 0, 2).reshape(picked.shape[1], -1)  # (L_moe, N k)
            counts = torch.zeros(flat.shape[0], self.num_experts, dtype=torch.float64, device=flat.device)
            counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
            self._counts = counts.cpu() if self._counts is None else self._counts + counts.cpu()

    def critic_step(self, is_finite: bool) -> None:
        """The critic's optimizer step after the policy's (skipped with it on a non-finite update)."""
        if self.critic is None:
            return
        if is_finite:
            self.critic.step()
        else:
            self.critic.optimizer.zero_grad(set_to_none=True)

    # -- after the updates ---------------------------------------------------------------------

    def end_step(self) -> None:
        """Once per trainer step: the critic's LR schedule; the per-expert token counts summed over the
        data-parallel ranks (``reduce``, a collective on a sharded trainer) and the correction-bias update
        from them."""
        if self.critic is not None:
            self.critic.scheduler.step()
        if self._counts is not None:
            self._counts = self.reduce(self._counts)  # collective: every rank's tokens
        if self.cfg.bias_update_rate > 0 and self._counts is not None:
            counts = self._counts.to(self.bias_blocks[0].router.e_score_correction_bias.device)
            for block, layer_counts in zip(self.bias_blocks, counts, strict=False):
                update_correction_bias(
                    block.router.e_score_correction_bias, layer_counts, self.cfg.bias_update_rate
                )

    def stats(self, batch: TrainBatch) -> AlgoStats:
        """The step's ``AlgoStats`` over the global batch (after ``end_step``; one ``reduce`` of the
        figures' sums and of the step's loss-token count). ``batch``: this rank's rows of the step."""
        keys = sorted(self._sums)
        local = torch.tensor(
            [*(self._sums[k] for k in keys), *self._rollout.tolist(), float(batch.num_tokens)],
            dtype=torch.float64,
        )
        total = self.reduce(local).tolist()  # collective on a sharded trainer
        values = {k: (v if k in self._seen else NAN) for k, v in zip(keys, total, strict=False)}
        tokens = max(total[-1], 1.0)
        per_layer: tuple[float, ...] = ()
        if self._counts is not None:
            ratio = self._counts.max(dim=1).values / self._counts.min(dim=1).values.clamp_min(1)
            per_layer = tuple(float(r) for r in ratio)
        normalized = NAN
        if "value_loss" in self._seen and self._return_var > 0:
            normalized = values["value_loss"] / (0.5 * self._return_var)
        return AlgoStats(
            **values,
            rollout_logprob_abs_diff=total[len(keys)] / tokens,
            rollout_kl=total[len(keys) + 1] / tokens,
            value_explained_var=self._explained_var,
            value_loss_normalized=normalized,
            expert_load_max_min=max(per_layer) if per_layer else NAN,
            expert_load_max_min_per_layer=per_layer,
        )

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Checkpoint parts beyond the policy's: the critic's (the reference is rebuilt from the start
        checkpoint, correction biases are model buffers)."""
        return {"critic": self.critic.state_dict()} if self.critic is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` parts (a checkpoint without a critic leaves a fresh one)."""
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
