"""From one trainer step's groups, train stats and runtime counters to the ``METRIC_KEYS`` values."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from moerl.records import Group
from moerl.rollout.precision_gap import LogprobGap
from moerl.rollout.stats import EngineStats
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.queue import QueueStats
from moerl.trainer.local import TrainStats


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Wall seconds of the parts of one trainer step."""

    gen_s: float
    """Generation seconds of the step's groups: sync, the generate phase; async, the wall time
    between this batch and the previous one (the window in which the fleet produced it)."""
    wait_s: float
    """Seconds the trainer waited for the buffer (sync: 0, generation is gen_s)."""
    publish_s: float
    """Seconds spent publishing weights."""
    step_s: float
    """Wall seconds of the whole step."""
    eval_s: float = 0.0
    """Seconds of the step's held-out eval (0 when the step had none)."""
    final_save_s: float = 0.0
    """Seconds making the run's last version durable in the weight store (the last step only; 0 on the
    others); not part of ``publish_s``."""


def kv_values(kv: Sequence[EngineStats | None]) -> dict[str, float]:
    """The ``rollout/kv_*`` metrics from the workers' latest ``EngineStats`` (``WorkerStats.kv``); {} if none."""
    kv = [s for s in kv if s is not None]
    if not kv:
        return {}
    return {
        "rollout/kv_blocks_used": sum(s.blocks_used for s in kv),
        "rollout/kv_blocks_total": sum(s.blocks_total for s in kv),
        "rollout/kv_preemptions": sum(s.preemptions for s in kv),
        "rollout/kv_prefix_hit_tokens": sum(s.prefix_hit_tokens for s in kv),
        "rollout/kv_prefill_tokens": sum(s.prefill_tokens for s in kv),
        "rollout/kv_decoding_together_mean": statistics.fmean(s.mean_decode_batch for s in kv),
        **spec_values(kv),
    }


def spec_values(kv: Sequence[EngineStats]) -> dict[str, float | None]:
    """The ``rollout/spec_*`` and ``timing/spec_draft_s`` metrics from the engines' ``EngineStats``: the
    recent acceptance figures averaged over the engines that speculated (None: none did)."""
    rates = [s.spec_acceptance_recent for s in kv if s.spec_acceptance_recent is not None]
    per_step = [s.spec_accepted_per_step_recent for s in kv if s.spec_accepted_per_step_recent is not None]
    return {
        "rollout/spec_acceptance_rate": statistics.fmean(rates) if rates else None,
        "rollout/spec_accepted_per_step": statistics.fmean(per_step) if per_step else None,
        "timing/spec_draft_s": sum(s.spec_draft_s for s in kv) if any(s.spec_steps for s in kv) else None,
    }


def fp8_values(gap: LogprobGap | None, stats: TrainStats) -> dict[str, float | None]:
    """The ``rollout/fp8_*`` metrics of a run with ``rollout.weight_dtype=fp8``: from the step's
    ``LogprobGap`` (sync mode: both models re-run on the batch), else the mean from the trainer's own
    |trainer - engine| log-prob figure (``train/rollout_logprob_abs_diff``, no extra forward) and the
    max and greedy agreement unmeasured (None)."""
    if gap is not None:
        return {
            "rollout/fp8_logprob_gap_mean": gap.logprob_gap_mean,
            "rollout/fp8_logprob_gap_max": gap.logprob_gap_max,
            "rollout/fp8_greedy_agreement": gap.greedy_agreement,
        }
    return {"rollout/fp8_logprob_gap_mean": stats.algo.rollout_logprob_abs_diff}


def rollout_values(groups: Sequence[Group]) -> dict[str, float]:
    """Reward and response statistics of a batch of groups (``rollout/*``)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/zero_std_frac": sum(max(g.rewards) == min(g.rewards) for g in groups) / len(groups),
        "rollout/response_len_mean": statistics.fmean(len(s.response_ids) for s in samples),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def algo_values(stats: TrainStats) -> dict[str, float]:
    """The step's algorithm figures (``moerl.trainer.algorithms.AlgoStats``) under their metric names."""
    a = stats.algo
    return {
        "train/expert_load_max_min": a.expert_load_max_min,
        "train/is_weight_mean": a.is_weight_mean,
        "train/is_clipfrac": a.is_clipfrac,
        "train/rollout_logprob_abs_diff": a.rollout_logprob_abs_diff,
        "train/rollout_kl": a.rollout_kl,
        "train/kl_ref": a.kl_ref,
        "train/value_loss": a.value_loss,
        "train/value_explained_var": a.value_explained_var,
        "train/value_loss_normalized": a.value_loss_normalized,
    }


def step_values(
    groups: Sequence[Group],
    stats: TrainStats,
    timings: StepTimings,
    queue: QueueStats,
    buffer: BufferMetrics,
    *,
    accuracy: float | None,
    eval_mean_reward: float | None = None,
) -> dict[str, float | int | None]:
    """All ``METRIC_KEYS`` values of one step (``accuracy``, the held-out exact match, None when the step had
    no eval or the task has no notion of correctness; ``eval_mean_reward`` None when the step had no eval)."""
    response_tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    values: dict[str, float | int | None] = rollout_values(groups)
    values.update(
        {
            "perf/rollout_tokens_per_s": response_tokens / timings.gen_s if timings.gen_s > 0 else None,
            "perf/train_tokens_per_s": stats.num_tokens / stats.train_s if stats.train_s > 0 else None,
            "perf/step_time_s": timings.step_s,
            "timing/gen_s": timings.gen_s,
            "timing/train_s": stats.train_s,
            "timing/publish_s": timings.publish_s,
            "timing/wait_s": timings.wait_s,
            "timing/eval_s": timings.eval_s,
            "timing/final_save_s": timings.final_save_s,
            "buffer/depth": buffer.depth,
            "buffer/staleness_mean": buffer.staleness_mean,
            "buffer/staleness_max": buffer.staleness_max,
            "buffer/dropped_stale": buffer.dropped_stale,
            "queue/depth": queue.pending,
            "queue/requeued": queue.requeued,
            "train/pg_loss": stats.pg_loss,
            "train/pg_clipfrac": stats.pg_clipfrac,
            "train/ppo_kl": stats.ppo_kl,
            "train/entropy": stats.entropy,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/aux_loss": stats.aux_loss,
            "train/mtp_loss": stats.mtp_loss,
            "train/mtp_accuracy": stats.mtp_accuracy,
            "train/expert_load_cv": stats.expert_load_cv,
            **algo_values(stats),
            "eval/accuracy": accuracy,
            "eval/mean_reward": eval_mean_reward,
            "policy_version": stats.step,
        }
    )
    return values
