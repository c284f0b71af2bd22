"""Per-step metrics: the fixed schema of ``metrics.jsonl`` and its writer.

One JSON record per trainer step. Every record has ``step`` (1-based trainer step), ``wall_s``
(seconds since the run started, restarting runs continue the count) and every key of
``METRIC_KEYS``; a metric that was not measured at that step (``eval/accuracy`` between evals) is
``null``. Unknown keys are refused so that the schema stays fixed.

All values are numbers or ``null`` except ``rollout/workers``: one entry per rollout worker seen so far
(``{worker_id: {field: number or null}}`` with exactly the fields of ``WORKER_FIELDS``; a worker that
went away keeps its last totals with ``is_up`` 0). The same per-worker series are served by the
Prometheus endpoint (``moerl.telemetry.prometheus``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

METRIC_KEYS: tuple[str, ...] = (
    "rollout/reward_mean",  # mean reward of the step's samples
    "rollout/reward_std",  # std of the step's sample rewards
    "rollout/zero_std_frac",  # fraction of groups whose rewards are all equal (no GRPO signal)
    "rollout/response_len_mean",  # mean response length, tokens
    "rollout/truncated_frac",  # fraction of samples stopped by max_new_tokens
    "perf/rollout_tokens_per_s",  # generated tokens / generation seconds of the step's groups
    "perf/train_tokens_per_s",  # trained tokens (prompt + response) / train seconds
    "perf/step_time_s",  # wall seconds of the whole step (wait + train + publish + eval [+ final save])
    "timing/gen_s",  # generation seconds (sync: of this step's batch; async: summed over its groups)
    "timing/train_s",  # forward/backward/optimizer seconds
    "timing/publish_s",  # weight hand-off seconds (the final save is timing/final_save_s)
    "timing/wait_s",  # seconds the trainer waited for the buffer
    "timing/eval_s",  # seconds of the step's held-out eval (0 when the step had none)
    "timing/final_save_s",  # seconds making the last version durable (the last step only, else 0)
    "buffer/depth",  # groups in the buffer after the step's batch was taken
    "buffer/staleness_mean",  # mean (trainer version - group min policy version) over the batch
    "buffer/staleness_max",  # max of the same
    "buffer/dropped_stale",  # groups refused for staleness so far (cumulative)
    "queue/depth",  # tasks waiting in the queue
    "queue/requeued",  # tasks put back (expiry, release, staleness) so far (cumulative)
    "train/pg_loss",  # policy-gradient loss
    "train/pg_clipfrac",  # fraction of tokens whose ratio was clipped
    "train/ppo_kl",  # mean (proximal log-prob - current log-prob) over tokens (0 with one update per step)
    "train/entropy",  # mean token entropy of the current policy
    "train/grad_norm",  # global gradient norm before clipping
    "train/lr",  # learning rate of the step's optimizer updates (trainer.lr_schedule; a resume with a new
    # trainer.steps recomputes a cosine schedule over the new total)
    "train/aux_loss",  # MoE load-balancing loss
    "train/expert_load_cv",  # coefficient of variation of tokens per expert, mean over MoE layers
    "train/expert_load_max_min",  # worst MoE layer's (max tokens of an expert) / max(1, min tokens)
    "train/is_weight_mean",  # mean train/rollout mismatch importance weight over loss tokens
    "train/is_clipfrac",  # fraction of loss tokens whose mismatch weight was truncated or masked
    "train/rollout_logprob_abs_diff",  # mean |trainer - engine log-prob| over loss tokens (nats)
    "train/rollout_kl",  # k3 estimate of KL(engine || trainer) per loss token (nats)
    "train/kl_ref",  # KL(policy || reference) per loss token, algorithm.kl_kind estimator (kl_coef > 0)
    "train/value_loss",  # critic's clipped value loss (estimator gae)
    "train/value_explained_var",  # explained variance of the GAE returns by the critic (estimator gae)
    "train/value_loss_normalized",  # value_loss / (0.5 Var[returns]): 1 = a critic predicting the mean return
    "train/mtp_loss",  # MTP module's cross-entropy on the step's response tokens (trainer.mtp_loss_weight > 0; else null)
    "train/mtp_accuracy",  # share of response targets whose MTP argmax is the token after next (else null)
    "eval/accuracy",  # held-out exact match (only on eval steps; null for a task with no notion of correctness)
    "eval/mean_reward",  # mean held-out reward of the greedy responses (only on eval steps)
    "policy_version",  # trainer's weight version after the step
    "fleet/workers_alive",  # rollout workers answering liveness pings (async mode)
    "fleet/interruptions",  # workers that went away unasked: drained + killed (cumulative)
    "fleet/drained",  # workers that exited cleanly after a termination notice (cumulative)
    "fleet/killed",  # workers that died or stopped answering (cumulative)
    "fleet/lost_work_frac",  # generated tokens discarded by interruptions / generated tokens
    "fleet/time_to_replace_s",  # mean seconds from detecting a lost worker to its replacement answering
    "fleet/desired_workers",  # scaling hint for an external autoscaler (moerl.runtime.fleet)
    "fleet/spot_notices",  # termination notices received by rollout workers (cumulative)
    "fleet/lost_work_tokens",  # generated tokens discarded by interruptions (cumulative)
    "rollout/tokens_resumed",  # generated tokens carried into continued sequences, all workers (cumulative)
    "rollout/tokens_discarded",  # generated tokens thrown away: hard losses less snapshots, drains and aborts (cumulative)
    "fleet/nodes_lost",  # Ray nodes of the cluster seen dead or unreachable during the run (cumulative; async)
    "ep/intra_node_bytes",  # bytes EP ranks sent within a node, dispatch + combine (cumulative; null: no EP)
    "ep/inter_node_bytes",  # bytes EP ranks sent across nodes (cumulative; null: no EP)
    "rollout/workers",  # per-worker record: {worker_id: {WORKER_FIELDS}} (see the module docstring)
    "timing/weight_sync_s",  # trainer side: seconds to send the step's new version (async mode)
    "timing/weight_sync_worker_s",  # worker side: slowest first-bucket-offered -> version running, s
    "weights/sync_bytes",  # bytes of weights moved by the step's sync (per worker x workers)
    "weights/version_lag_max",  # max over live workers of trainer version - engine version
    "weights/version_lag_mean",  # mean of the same
    "weights/refused_total",  # weight versions refused by rollout workers so far (table, checksum or
    # parameter-set mismatch: never switched to; moerl.weights.sources; cumulative)
    "env/turns_mean",  # policy turns per episode of the step's samples (task.name env; else null)
    "env/latency_p50_s",  # median environment call latency, recent calls of every worker (moerl.envs)
    "env/latency_p99_s",  # 99th percentile of the same
    "env/errors",  # episodes ended by an environment fault so far: raised, timeout, died, lost (cumulative)
    "env/timeouts",  # environment calls past env.step_timeout_s so far (cumulative)
    "env/parked_max",  # most episodes parked at once on their environments, per worker (max over workers)
    "rollout/kv_blocks_used",  # KV cache blocks held by running sequences, summed over workers' engines (paged: blocks)
    "rollout/kv_blocks_total",  # KV cache blocks of those engines (slot engine: slots)
    "rollout/kv_preemptions",  # sequences preempted for lack of free blocks, all workers (cumulative)
    "rollout/kv_prefix_hit_tokens",  # prompt tokens shared instead of prefilled, all workers (cumulative)
    "rollout/kv_prefill_tokens",  # tokens prefilled, all workers (cumulative)
    "rollout/kv_decoding_together_mean",  # sequences per decode step since each engine started (mean over workers)
    "rollout/spec_acceptance_rate",  # rollout.speculative: accepted / drafted tokens over each engine's last 16 speculative steps (mean over workers; else null)
    "rollout/spec_accepted_per_step",  # accepted drafts per sequence and speculative step, same window
    "timing/spec_draft_s",  # seconds the engines spent drafting (cumulative, summed over workers)
    "rollout/fp8_logprob_gap_mean",  # rollout.weight_dtype=fp8: mean |FP8 engine - policy| log-prob of the step's response tokens (nats; else null)
    "rollout/fp8_logprob_gap_max",  # the largest such gap (sync mode: both models re-run on the batch; async: null)
    "rollout/fp8_greedy_agreement",  # fraction of response positions where FP8 and policy argmax agree (sync mode; async: null)
    "reward/latency_s",  # mean seconds per reward-model batch since the previous step (null: no reward model)
    "reward/batch_size",  # mean sequences per reward-model batch since the previous step
    "reward/score_mean",  # mean raw reward-model score of the sequences scored since the previous step
    "reward/score_std",  # std of the same
    "reward/retries",  # reward batches scored again after a lost or timed-out reward worker (cumulative)
    "reward/workers_lost",  # reward workers that died or timed out and were replaced (cumulative)
)
"""The fixed metric names, in the order they are written."""

WALL_KEYS = (
    "wall_s",
    "env/latency_p50_s",
    "env/latency_p99_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/step_time_s",
    "timing/gen_s",
    "timing/train_s",
    "timing/publish_s",
    "timing/wait_s",
    "timing/eval_s",
    "timing/final_save_s",
    "timing/weight_sync_s",
    "timing/weight_sync_worker_s",
    "reward/latency_s",
    "timing/spec_draft_s",
)
"""Fields that depend on wall-clock time (excluded when comparing two runs for equality)."""

ENGINE_LIFE_KEYS = (
    "rollout/kv_blocks_used",
    "rollout/kv_blocks_total",
    "rollout/kv_preemptions",
    "rollout/kv_prefix_hit_tokens",
    "rollout/kv_prefill_tokens",
    "rollout/kv_decoding_together_mean",
    "rollout/spec_acceptance_rate",
    "rollout/spec_accepted_per_step",
    "timing/spec_draft_s",
)
"""Fields that depend on the rollout engine's life (counters since it started, prefix hits on what its
cache still holds): a resumed run's engines start empty, so these are excluded from run-to-run equality
as the per-worker totals are."""

WORKERS_KEY = "rollout/workers"

WORKER_FIELDS: tuple[str, ...] = (
    "tokens_per_s",  # response tokens delivered per second over the trailing 10 s (null: first record)
    "groups_per_s",  # groups delivered per second over the trailing 10 s (null: first record)
    "tokens_total",  # response tokens delivered (cumulative, this worker's life)
    "groups_total",  # groups delivered (cumulative)
    "policy_lag",  # trainer version when its last heartbeat was asked for - its weights version (null: none yet)
    "spot_notices",  # termination notices it received (cumulative)
    "is_up",  # 1 while it answers liveness pings, 0 once gone
    "tokens_resumed",  # generated tokens it carried into continued sequences (cumulative)
    "tokens_discarded",  # its generated tokens thrown away (cumulative; a hard loss less its snapshots)
)
"""Fields of each ``rollout/workers`` entry, in order."""

EVAL_KEY = re.compile(r"eval/([A-Za-z0-9_.-]+/)?(accuracy|mean_reward|pass@\d+|mean@\d+)")
"""Eval metrics beyond ``METRIC_KEYS`` that a run's config adds (``eval.k``, several ``task.val_path`` sets):
``eval/pass@<k>``, ``eval/mean@<k>``, ``eval/<set>/accuracy``, ``eval/<set>/mean_reward``,
``eval/<set>/pass@<k>``, ``eval/<set>/mean@<k>`` (``moerl.tasks.eval.eval_keys``)."""

WORKER_WALL_FIELDS = ("tokens_per_s", "groups_per_s", "tokens_total", "groups_total")
"""Per-worker fields left out when two runs are compared: the rates depend on wall-clock time, the
totals on the worker process's life (a resumed run's workers start again from 0)."""


def _clean(value: float | int | None) -> float | int | None:
    """JSON has no NaN/inf: non-finite values become ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric values must be numbers or None, got {type(value).__name__}: {value!r}")
    return value if math.isfinite(value) else None


def make_record(
    step: int, wall_s: float, values: dict[str, float | int | None]
) -> dict[str, float | int | None]:
    """A schema-complete record: ``step``, ``wall_s`` and every ``METRIC_KEYS`` entry (missing: None).

    Keys of the run's eval (``EVAL_KEY``: ``eval/pass@4``, ``eval/<set>/accuracy``, ...) are written too;
    the run passes the same ones at every step (``moerl.tasks.eval.eval_keys``).

    Raises:
        KeyError: ``values`` has a key outside ``METRIC_KEYS`` and ``EVAL_KEY``.
        TypeError: a value is not a number or None.
    """
    unknown = sorted(k for k in set(values) - set(METRIC_KEYS) if not EVAL_KEY.fullmatch(k))
    if unknown:
        raise KeyError(f"metrics outside the fixed schema: {unknown}; allowed: {list(METRIC_KEYS)}")
    record: dict[str, float | int | None] = {"step": int(step), "wall_s": round(float(wall_s), 4)}
    for key in METRIC_KEYS:
        record[key] = _clean_workers(values.get(key)) if key == WORKERS_KEY else _clean(values.get(key))
    for key in sorted(set(values) - set(METRIC_KEYS)):  # the run's eval keys, the same at every step
        record[key] = _clean(values[key])
    return record


def _clean_workers(workers: dict | None) -> dict | None:
    """A ``rollout/workers`` value with exactly ``WORKER_FIELDS`` per worker (missing fields: None)."""
    if workers is None:
        return None
    if not isinstance(workers, dict):
        raise TypeError(f"{WORKERS_KEY} must be a dict of worker id -> fields, got {type(workers).__name__}")
    out = {}
    for wid, entry in sorted(workers.items()):
        unknown = sorted(set(entry) - set(WORKER_FIELDS))
        if unknown:
            raise KeyError(
                f"{WORKERS_KEY}[{wid!r}]: fields outside the schema: {unknown}; allowed: {list(WORKER_FIELDS)}"
            )
        out[str(wid)] = {name: _clean(entry.get(name)) for name in WORKER_FIELDS}
    return out


class MetricsWriter:
    """Appends schema-complete records to ``metrics.jsonl``, one flushed line per step.

    Args:
        path: the JSONL file (appended to; a resumed run first rewinds it, see RunDir.rewind).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, step: int, wall_s: float, values: dict[str, float | int | None]) -> dict:
        """Validate, write and return the record (see ``make_record``)."""
        record = make_record(step, wall_s, values)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        return record


def without_wall_clock(record: dict) -> dict:
    """The record minus the fields that depend on wall-clock time or on a process's life (for run-to-run
    equality: ``WALL_KEYS``, ``ENGINE_LIFE_KEYS``, ``WORKER_WALL_FIELDS``)."""
    out = {k: v for k, v in record.items() if k not in WALL_KEYS and k not in ENGINE_LIFE_KEYS}
    if out.get(WORKERS_KEY):
        out[WORKERS_KEY] = {
            wid: {f: v for f, v in entry.items() if f not in WORKER_WALL_FIELDS}
            for wid, entry in out[WORKERS_KEY].items()
        }
    return out
