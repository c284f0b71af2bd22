"""The trainer: groups -> padded batch -> micro-batched policy-gradient step -> published weights.

Shapes: B sequences of the step (groups x n), T the longest prompt + response, V vocabulary,
L_moe MoE layers, k experts per token, E experts per layer. Per-token tensors are ``[B, T]`` and
aligned with ``input_ids`` as ``moerl.rl.token_logprobs`` returns them: position t describes token t
(predicted from the logits at t - 1), position 0 is never trained.

One step (``LocalTrainer.train_step``)::

    prepare (no grad, moerl.trainer.algorithms): [proximal log-probs if recompute_proximal]
        [reference log-probs if kl_coef > 0] [critic values -> GAE advantages if estimator gae]
    for each of ppo_epochs, for each of mini_batches (one optimizer step each):
        for each micro-batch: forward (each group's prompt once: moerl.trainer.shared_prefix; the
                              engine's experts replayed with routing_replay=r3)
                              -> token log-probs -> policy_loss (mini-batch num_tokens / num_seqs,
                              mismatch correction from the engine's behaviour log-probs)
                              + aux_loss_coef * aux_loss [+ value loss] -> backward
        non-finite loss or gradient norm -> skip the update, count it, stop after max_nan_steps in a row
        clip the global gradient norm -> AdamW step [critic step]
    LR schedule step; [correction-bias update if bias_update_rate > 0]

The policy version is the number of trainer steps taken: weights after step s are version s.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from moerl.config import AlgorithmConfig, RunConfig, TrainerConfig
from moerl.lr_schedule import warmup_cosine_lr
from moerl.models import save_pretrained
from moerl.models.mtp import attach_fresh_mtp, mtp_loss
from moerl.records import Group, WeightVersion
from moerl.rl import (
    entropy_from_logits,
    policy_loss,
    preset_from_config,
    token_logprobs,
)
from moerl.trainer import algorithms
from moerl.trainer.batch import TrainBatch, build_train_batch
from moerl.trainer.checkpoint import capture_rng_state, save_checkpoint
from moerl.trainer.shared_prefix import shared_prefix_forward, split_shared_prefix
from moerl.weights.buckets import StreamedVersion
from moerl.weights.store import WeightStore
from moerl.weights.transports import stream_named

IGNORE_INDEX = -100


class NonFiniteLossError(RuntimeError):
    """``trainer.max_nan_steps`` consecutive steps had a non-finite loss or gradient; the run stops."""


def expert_load_cv(routed_experts: torch.Tensor, token_mask: torch.Tensor, num_experts: int) -> float:
    """Mean over MoE layers of the coefficient of variation of tokens routed to each expert.

    CV = std / mean of the per-expert assignment counts (population std), 0 for a perfectly
    balanced router; the usual load-imbalance measure (Shazeer et al. 2017, "Outrageously Large
    Neural Networks", Sec. 4 and eq. 6 use CV^2 as the importance loss).

    Args:
        routed_experts: [B, T, L_moe, k] int64 expert ids.
        token_mask: [B, T], nonzero at real tokens.
        num_experts: E.

    Returns:
        The mean CV (float); 0.0 without MoE layers or tokens.
    """
    if routed_experts.numel() == 0 or not bool(token_mask.any()):
        return 0.0
    picked = routed_experts[token_mask.bool()]  # (N, L_moe, k)
    cvs = []
    for layer in range(picked.shape[1]):
        counts = torch.bincount(picked[:, layer].reshape(-1), minlength=num_experts).double()
        cvs.append(float(counts.std(unbiased=False) / counts.mean()))
    return sum(cvs) / len(cvs)


@dataclass(frozen=True, slots=True)
class _Forward:
    """One micro-batch's forward, as the loss and the metrics use it."""

    logp: torch.Tensor
    """[B, T] float32 token log-probs in the batch layout (0 where not trained)."""
    logits: torch.Tensor
    """[B, T', V] logits aligned with ``labels`` (T' = T, or the suffix length S when shared)."""
    labels: torch.Tensor
    """[B, T'] int64 trained tokens, ``IGNORE_INDEX`` elsewhere."""
    aux_loss: torch.Tensor
    """scalar float32 load-balancing loss."""
    routed_experts: torch.Tensor | None
    """[B, T, L_moe, k] int64 or None."""
    hidden: torch.Tensor | None = None
    """[B, T, H] final hidden states (``trainer.mtp_loss_weight > 0``: the MTP module's input), or None."""


@dataclass(frozen=True, slots=True)
class TrainStats:
    """What one ``train_step`` did; loss metrics are token means over the step unless noted."""

    step: int
    """Trainer step after this one (1-based); also the new policy version."""
    pg_loss: float
    """Policy-gradient loss, summed over micro-batches (each aggregated with the global normalizers)."""
    pg_clipfrac: float
    """Fraction of loss tokens whose ratio was clipped."""
    ppo_kl: float
    """Mean of old log-prob - current log-prob over loss tokens."""
    entropy: float
    """Mean token entropy of the current policy over loss tokens (nats)."""
    grad_norm: float
    """Global gradient norm before clipping (NaN on a skipped step)."""
    aux_loss: float
    """MoE load-balancing loss: row-weighted mean of each micro-batch's loss (each rank's micro-batches when
    sharded: ``TrainerConfig.aux_loss_coef``); a shared-prompt forward counts a group's prompt once."""
    expert_load_cv: float
    """See ``expert_load_cv``; mean over micro-batches."""
    num_tokens: int
    """Tokens forwarded (prompt + response, no padding) in the step."""
    train_s: float
    """Wall seconds of the step (forward, backward, optimizer)."""
    lr: float
    """Learning rate used by the step."""
    is_skipped: bool
    """True when the loss or gradient was non-finite and no update was made."""
    algo: algorithms.AlgoStats = algorithms.AlgoStats()
    """Mismatch, KL, critic and expert-load figures of the step (``moerl.trainer.algorithms``)."""
    mtp_loss: float | None = None
    """MTP cross-entropy (nats, token mean over response targets; ``moerl.models.mtp.mtp_loss``), mean over
    the step's updates; None without ``trainer.mtp_loss_weight``."""
    mtp_accuracy: float | None = None
    """Share of response targets whose MTP argmax is the token after next (the greedy draft's hit rate)."""


def lr_factor(cfg: TrainerConfig, step: int) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based): linear warm-up over
    ``cfg.warmup_steps``, then 1 (``constant``) or a cosine from 1 to 0.1 reached at ``cfg.steps``
    (``cosine``: ``moerl.lr_schedule.warmup_cosine_lr``)."""
    if cfg.lr_schedule == "constant" and step >= cfg.warmup_steps:
        return 1.0
    return warmup_cosine_lr(step, cfg.steps, cfg.warmup_steps)


class LocalTrainer:
    """Owns the policy being trained, its AdamW optimizer and LR schedule: the one-process implementation
    of ``moerl.trainer.protocol.Trainer``.

    Args:
        model: the policy (``moerl.models.MoeForCausalLM``), on its training device.
        cfg: the trainer's config.
        algorithm: the loss preset and coefficients (``moerl.rl.preset_from_config``).
        temperature: rollout sampling temperature (log-probs are of softmax(logits / T)); 0 (greedy)
            uses 1.
        norm_length: constant length of the ``seq-mean-token-sum-norm`` aggregation (Dr. GRPO),
            normally ``rollout.max_new_tokens``.
        start_policy: the policy RL started from, which the reference policy and the critic's trunk
            copy; None: ``model`` (right unless ``model`` holds other weights now, as in a restart).
        reference_model, value_model: already built (sharded) reference policy and value model, used
            instead of copies of ``start_policy`` (``moerl.trainer.distributed.ShardedTrainer``).

    Builds, as the algorithm asks (``moerl.trainer.algorithms.AlgoParts``): a frozen reference policy
    (``kl_coef > 0``), a critic (estimator ``gae``), routing replay (``routing_replay=r3``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        norm_length: int | None = None,
        start_policy: torch.nn.Module | None = None,
        reference_model: torch.nn.Module | None = None,
        value_model: torch.nn.Module | None = None,
    ):
        self.preset = preset_from_config(algorithm)
        self.model = model
        self.cfg = cfg
        self.algorithm = algorithm
        self.temperature = temperature if temperature > 0 else 1.0
        self.norm_length = norm_length
        if cfg.mtp_loss_weight > 0:  # before the optimizer is built: the MTP module's parameters train too
            attach_fresh_mtp(model)
        self._mtp_sums = {"mtp_loss": 0.0, "mtp_accuracy": 0.0}
        if hasattr(model, "activation_checkpointing"):
            model.activation_checkpointing = cfg.activation_checkpointing
        # fused=True: one kernel per step instead of the foreach chain on CUDA (bench/NOTES.md, section 4)
        # and instead of ~10 dispatched ops per parameter on CPU (1.5 ms -> 0.5 ms a step, default model).
        # Sharded (DTensor) parameters take the foreach path.
        is_fusable = next(model.parameters()).device.type in ("cuda", "cpu") and not any(
            isinstance(p, DTensor) for p in model.parameters()
        )
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=is_fusable or None
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(cfg, s))
        self.step = 0
        self.version_offset = 0
        """Policy version minus step; raised when a restarted trainer resumes an older checkpoint
        (``moerl.run.recovery``), so that versions never go backwards."""
        self.nan_streak = 0
        self.num_skipped = 0
        self.num_ranks = 1
        self.last_ep_traffic = None  # one process: no EP bytes cross ranks
        self.device = next(model.parameters()).device
        self.num_experts = int(getattr(getattr(model, "config", None), "num_experts", 0) or 0)
        self._has_published = False
        self._background_store: WeightStore | None = None
        # Reference policy, critic, routing replay, balancing: moerl.trainer.algorithms.
        self.algo = algorithms.AlgoParts.build(
            model,
            cfg,
            algorithm,
            self.preset,
            lambda s: lr_factor(cfg, s),
            start_policy=start_policy,
            reference_model=reference_model,
            value_model=value_model,
            reduce=self._all_reduce_sum,
            clip_grad_norm=self._clip_params_grad_norm,
        )

    @classmethod
    def from_run_config(
        cls, model: torch.nn.Module, cfg: RunConfig, *, start_policy: torch.nn.Module | None = None
    ) -> LocalTrainer:
        """The run's trainer: ``cfg.trainer`` and ``cfg.algorithm``, log-probs at the rollout temperature,
        length normalization over ``algorithm.norm_length`` or else ``rollout.max_new_tokens``."""
        return cls(
            model,
            cfg.trainer,
            cfg.algorithm,
            temperature=cfg.rollout.temperature,
            norm_length=cfg.algorithm.norm_length or cfg.rollout.max_new_tokens,
            start_policy=start_policy,
        )

    @staticmethod
    def needs_value_model(algorithm: AlgorithmConfig) -> bool:
        """Whether ``algorithm`` trains a critic (the ``gae`` estimator)."""
        return preset_from_config(algorithm).estimator == "gae"

    @property
    def version(self) -> int:
        """Policy version of the current weights: trainer steps taken + ``version_offset``."""
        return self.step + self.version_offset

    @property
    def pids(self) -> list[int]:
        """This process: the one training rank."""
        return [os.getpid()]

    def build_batch(self, groups: Sequence[Group], pad_id: int) -> TrainBatch:
        """``build_train_batch`` with this trainer's advantage estimator."""
        return build_train_batch(groups, pad_id=pad_id, estimator=self.preset.estimator)

    def _forward(self, mb: TrainBatch, *, with_grad: bool, model: torch.nn.Module | None = None) -> _Forward:
        """Token log-probs of ``mb`` under ``model`` (default: the policy's current weights); each group's
        prompt runs once when ``trainer.share_prompt`` allows it (``moerl.trainer.shared_prefix``); with
        ``routing_replay=r3`` the engine's recorded experts are replayed (``algorithms.forced_experts``)."""
        model = self.model if model is None else model
        ids = mb.input_ids.to(self.device)
        attn = mb.attention_mask.to(self.device)
        labels = torch.where(mb.loss_mask.to(self.device), ids, IGNORE_INDEX)
        routed = with_grad and self.num_experts > 0
        forced = self.algo.forced_experts(mb, self.device)
        want_hidden = with_grad and self.cfg.mtp_loss_weight > 0  # the MTP loss needs every position's
        split = None
        if (
            self.cfg.share_prompt
            and self.cfg.aux_loss_coef == 0
            and mb.prompt_lens is not None
            and not want_hidden
        ):
            split = split_shared_prefix(
                ids, attn, mb.prompt_lens.to(self.device), mb.group_ids.to(self.device)
            )
        with torch.set_grad_enabled(with_grad):
            if split is None:
                out = model(
                    ids, attn, forced_experts=forced, return_routed_experts=routed, return_hidden=want_hidden
                )
                logp = token_logprobs(out.logits, labels, self.temperature)
                return _Forward(logp, out.logits, labels, out.aux_loss, out.routed_experts, out.hidden)
            shared = shared_prefix_forward(
                model, split, ids.shape[1], return_routed_experts=routed, forced_experts=forced
            )
            suffix_labels = split.to_suffix(labels, IGNORE_INDEX)  # (B, S), aligned with shared.logits
            logp = split.to_batch(
                token_logprobs(shared.logits, suffix_labels, self.temperature), ids.shape[1]
            )
            return _Forward(logp, shared.logits, suffix_labels, shared.aux_loss, shared.routed_experts)

    @torch.no_grad()
    def no_grad_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """[B, T] float32 token log-probs of ``batch`` under ``model`` (default: the policy), no gradient,
        micro-batch by micro-batch (the proximal policy, or the reference policy)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        row = 0
        for mb in batch.micro_batches(self.cfg.micro_batch_size):
            logp = self._forward(mb, with_grad=False, model=model).logp
            out[row : row + logp.shape[0], : logp.shape[1]] = logp
            row += logp.shape[0]
        return out

    @torch.no_grad()
    def _proximal_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Log-probs of the current weights before the update (decoupled PPO's proximal policy), one
        [b, t] tensor per micro-batch."""
        return [
            self._forward(mb, with_grad=False).logp for mb in batch.micro_batches(self.cfg.micro_batch_size)
        ]

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One trainer step on ``batch``: ``ppo_epochs x mini_batches`` optimizer steps (see the module
        docstring); the policy version advances by one.

        Raises:
            NonFiniteLossError: this is the ``max_nan_steps``-th non-finite update in a row.
        """
        start = time.perf_counter()
        self.model.train()
        batch = self.algo.prepare(self, batch)
        sums = dict.fromkeys(
            ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "aux_loss", "expert_load_cv"), 0.0
        )
        lr = self.optimizer.param_groups[0]["lr"]
        norms = []
        self._mtp_sums = {"mtp_loss": 0.0, "mtp_accuracy": 0.0}
        minis = batch.mini_batches(self.cfg.mini_batches)
        for epoch in range(self.cfg.ppo_epochs):
            for mini in minis:
                norms.append(self._update(mini, sums, is_first_epoch=epoch == 0))
        for key in sums:
            sums[key] /= len(norms)
        if any(math.isfinite(n) for n in norms):
            self.scheduler.step()
        self.algo.end_step()
        self.step += 1
        return TrainStats(
            step=self.step,
            grad_norm=norms[-1],
            num_tokens=int(self._sum_over_ranks([batch.attention_mask.sum()])[0]),
            train_s=time.perf_counter() - start,
            lr=lr,
            is_skipped=any(math.isnan(n) for n in norms),
            algo=self.algo.stats(batch),
            **sums,
            **self._mtp_stats(len(norms)),
        )

    def _mtp_stats(self, num_updates: int) -> dict[str, float | None]:
        """``mtp_loss`` / ``mtp_accuracy`` of the step (means over its updates), None when not trained."""
        if self.cfg.mtp_loss_weight == 0:
            return {"mtp_loss": None, "mtp_accuracy": None}
        return {k: v / max(num_updates, 1) for k, v in self._mtp_sums.items()}

    def _update(self, mini: TrainBatch, sums: dict[str, float], *, is_first_epoch: bool) -> float:
        """One optimizer step on a mini-batch (gradients accumulated over its micro-batches, normalized by
        the mini-batch's ``num_tokens`` / ``num_seqs``); adds its metrics to ``sums``. Returns the norm."""
        self.optimizer.zero_grad(set_to_none=True)
        is_finite = True
        mini = self._with_global_normalizers(mini)  # num_tokens / num_seqs over all data-parallel ranks
        num_rows = int(self._sum_over_ranks([mini.num_sequences])[0])  # rows over all data-parallel ranks
        part = dict.fromkeys(sums, 0.0)  # this update's metrics, summed over the ranks below
        mtp_part = self._mtp_sums
        for mb in mini.micro_batches(self.cfg.micro_batch_size):
            out = self._forward(mb, with_grad=True)
            mask = mb.loss_mask.to(self.device)
            loss, m = policy_loss(
                out.logp,
                advantages=mb.advantages.to(self.device),
                mask=mask,
                preset=self.preset,
                num_tokens=max(mini.num_tokens, 1),
                num_seqs=max(mini.num_seqs, 1),
                norm_length=self.norm_length,
                **self.algo.loss_inputs(mb, self.device, is_single_update=self.algo.num_updates == 1),
            )
            share = mb.num_sequences / num_rows
            if self.cfg.aux_loss_coef > 0:
                loss = loss + self.cfg.aux_loss_coef * share * out.aux_loss
            if (
                out.hidden is not None
            ):  # trainer.mtp_loss_weight > 0: the draft module learns beside the policy
                m_loss, m_acc = mtp_loss(
                    self.model,
                    out.hidden,
                    mb.input_ids.to(self.device),
                    mask,
                    mb.attention_mask.to(self.device),
                )
                loss = loss + self.cfg.mtp_loss_weight * share * m_loss
                mtp_part["mtp_loss"] += float(m_loss.detach()) * share
                mtp_part["mtp_accuracy"] += float(m_acc) * share
            ent = None
            if self.algorithm.entropy_coef > 0:  # 0 where not trained: the sum is over loss tokens
                ent = entropy_from_logits(out.logits, out.labels, temperature=self.temperature)
                loss = loss - self.algorithm.entropy_coef * ent.sum() / max(mini.num_tokens, 1)
            loss = loss + self.algo.critic_loss(mb, mini.num_tokens)
            is_finite = is_finite and bool(torch.isfinite(loss))
            if is_finite or self._num_ranks() > 1:  # sharded: every rank runs the backward collectives
                loss.backward()
            with torch.no_grad():
                tok_share = float(mask.sum()) / max(mini.num_tokens, 1)
                part["pg_loss"] += m["pg_loss"]
                part["pg_clipfrac"] += m["pg_clipfrac"] * tok_share
                part["ppo_kl"] += m["ppo_kl"] * tok_share
                ent_sum = float(ent.sum()) if ent is not None else self._entropy_sum(out.logits, out.labels)
                part["entropy"] += ent_sum / max(mini.num_tokens, 1)
                part["aux_loss"] += float(out.aux_loss) * share
                if out.routed_experts is not None:
                    cv = expert_load_cv(
                        out.routed_experts, self.algo.load_mask(mb).to(self.device), self.num_experts
                    )
                    part["expert_load_cv"] += cv * share
                self.algo.observe(
                    mb, out.logp, out.routed_experts, m, tok_share, is_first_epoch=is_first_epoch
                )
        keys = sorted(part)
        totals = self._sum_over_ranks([*(part[k] for k in keys), is_finite])
        for key, total in zip(keys, totals, strict=False):
            sums[key] += total
        norm = self._clip_and_step(totals[-1] == self._num_ranks())
        self.algo.critic_step(math.isfinite(norm))
        return norm

    def _entropy_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> float:
        """Sum over the trained positions (``labels != IGNORE_INDEX``) of the next-token entropy of
        softmax(logits / temperature), in nats: ``moerl.rl.entropy_from_logits``, which computes only those
        positions. logits [B, T, V], labels [B, T] int64."""
        with torch.no_grad():
            return float(entropy_from_logits(logits, labels, temperature=self.temperature).sum())

    # -- hooks of a data-parallel trainer (``moerl.trainer.distributed.ShardedTrainer``); one rank: identities

    def _num_ranks(self) -> int:
        """Data-parallel ranks whose batches together make the step (1 here)."""
        return 1

    def _with_global_normalizers(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` with ``num_tokens`` / ``num_seqs`` over the whole step (here: its own)."""
        return batch

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over the data-parallel ranks (here: unchanged)."""
        return [float(v) for v in values]

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU float64 tensor summed elementwise over the data-parallel ranks (here: ``t``)."""
        return t

    def _clip_params_grad_norm(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        """Global L2 norm of the gradients of ``parameters`` before clipping, after scaling them to at most
        ``max_norm`` (``torch.nn.utils.clip_grad_norm_``)."""
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of all gradients before clipping, after scaling them to at most ``max_norm``."""
        return self._clip_params_grad_norm(list(self.model.parameters()), max_norm)

    def _clip_and_step(self, is_finite: bool) -> float:
        """Clip and step the optimizer (the LR schedule steps once per trainer step, in ``train_step``); on
        a non-finite loss/gradient skip and count. Returns the norm."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = float("nan")
        if is_finite:
            grad_norm = self._clip_grad_norm(max_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.nan_streak += 1
            self.num_skipped += 1
            if self.nan_streak >= self.cfg.max_nan_steps:
                raise NonFiniteLossError(
                    f"{self.nan_streak} trainer steps in a row (up to step {self.step + 1}) had a non-finite loss "
                    f"or gradient (trainer.max_nan_steps={self.cfg.max_nan_steps}); stopping. Try a lower "
                    "trainer.lr, trainer.grad_clip > 0, or check the rewards and the checkpoint for NaN/inf."
                )
            return float("nan")
        self.nan_streak = 0
        self.optimizer.step()
        return grad_norm

    # -- weights and state ---------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's parameters and buffers by ``state_dict`` name, detached (shares storage)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def stream_buckets(self, sink, bucket_bytes: int) -> StreamedVersion:
        """Pack the current version in buckets of about ``bucket_bytes`` (one reused staging buffer) and
        send each to ``sink`` (a ``moerl.weights.transport.BucketSink``); what a weight transport asks."""
        return stream_named(self.version, self.named_weights(), bucket_bytes, sink)

    def publish(self, store: WeightStore) -> WeightVersion | None:
        """Write the current weights to ``store`` as version ``self.version`` (atomic, manifest last).

        With ``trainer.background_publish``, every publish but this trainer's first and the one at
        ``trainer.steps`` is handed to ``store.publish_in_background`` (from a copy of the weights) and
        returns ``None`` at once; the others return the committed ``WeightVersion``. ``checkpoint`` and
        the store's own readers wait for a background write first.
        """
        if self.cfg.background_publish and self._has_published and self.step < self.cfg.steps:
            store.publish_in_background(self.version, self.named_weights())
            self._background_store = store
            return None
        self._has_published = True
        return store.publish(self.version, self.named_weights())

    def state_dict(self) -> dict:
        """Checkpoint parts of the trainer: model, optimizer, scheduler and counters."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "trainer": {
                "step": self.step,
                "nan_streak": self.nan_streak,
                "num_skipped": self.num_skipped,
                "version_offset": self.version_offset,
            },
            **self.algo.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` parts (after a checkpoint round trip)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        counters = state["trainer"]
        self.step, self.nan_streak, self.num_skipped = (
            counters["step"],
            counters["nan_streak"],
            counters["num_skipped"],
        )
        self.version_offset = counters.get("version_offset", 0)
        self.algo.load_state_dict(state)

    def checkpoint(self, run_dir: str | Path, extra: dict, *, keep: int = 2) -> Path:
        """Save the full run state after this step: trainer parts, RNG streams and ``extra`` parts
        (queue, buffer, controller state) atomically as ``checkpoints/step_<step>``, once the weights
        published in the background have been committed to their store."""
        if self._background_store is not None:
            self._background_store.flush()
        return save_checkpoint(
            run_dir, self.step, {**self.state_dict(), "rng": capture_rng_state(), **extra}, keep=keep
        )

    def refresh_model(self) -> None:
        """Nothing to do: evaluation reads this trainer's own model."""

    def export_policy(self, folder: str | Path, extra: Callable[[Path], None] | None = None) -> Path:
        """``save_pretrained`` of the policy to ``folder`` (atomic folder rename), ``extra`` adding files."""
        save_pretrained(self.model, folder, extra=extra)
        return Path(folder)

    def close(self) -> None:
        """Nothing to stop: the trainer is this process."""
