"""Per-step metrics: the fixed schema of ``metrics.jsonl`` and its writer.

One JSON record per trainer step. Every record has ``step`` (1-based trainer step), ``wall_s``
(seconds since the run started, restarting runs continue the count) and every key of
``METRIC_KEYS``; a metric that was not measured at that step (``eval/accuracy`` between evals) is
``null``. Unknown keys are refused so that the schema stays fixed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

METRIC_KEYS: tuple[str, ...] = (
    "rollout/reward_mean",  # mean reward of the step's samples
    "rollout/reward_std",  # std of the step's sample rewards
    "rollout/zero_std_frac",  # fraction of groups whose rewards are all equal (no GRPO signal)
    "rollout/response_len_mean",  # mean response length, tokens
    "rollout/truncated_frac",  # fraction of samples stopped by max_new_tokens
    "perf/rollout_tokens_per_s",  # generated tokens / generation seconds of the step's groups
    "perf/train_tokens_per_s",  # trained tokens (prompt + response) / train seconds
    "perf/step_time_s",  # wall seconds of the whole step (wait + train + publish + eval)
    "timing/gen_s",  # generation seconds (sync: of this step's batch; async: summed over its groups)
    "timing/train_s",  # forward/backward/optimizer seconds
    "timing/publish_s",  # weight publication seconds
    "timing/wait_s",  # seconds the trainer waited for the buffer
    "buffer/depth",  # groups in the buffer after the step's batch was taken
    "buffer/staleness_mean",  # mean (trainer version - group min policy version) over the batch
    "buffer/staleness_max",  # max of the same
    "buffer/dropped_stale",  # groups refused for staleness so far (cumulative)
    "queue/depth",  # tasks waiting in the queue
    "queue/requeued",  # tasks put back (expiry, release, staleness) so far (cumulative)
    "train/pg_loss",  # policy-gradient loss
    "train/pg_clipfrac",  # fraction of tokens whose ratio was clipped
    "train/ppo_kl",  # mean (behaviour/proximal log-prob - current log-prob) over tokens
    "train/entropy",  # mean token entropy of the current policy
    "train/grad_norm",  # global gradient norm before clipping
    "train/aux_loss",  # MoE load-balancing loss
    "train/expert_load_cv",  # coefficient of variation of tokens per expert, mean over MoE layers
    "eval/accuracy",  # held-out exact-match accuracy (only on eval steps)
    "policy_version",  # trainer's weight version after the step
    "fleet/workers_alive",  # rollout workers answering liveness pings (async mode)
    "fleet/interruptions",  # workers that went away unasked: drained + killed (cumulative)
    "fleet/drained",  # workers that exited cleanly after a termination notice (cumulative)
    "fleet/killed",  # workers that died or stopped answering (cumulative)
    "fleet/lost_work_frac",  # generated tokens discarded by interruptions / generated tokens
    "fleet/time_to_replace_s",  # mean seconds from detecting a lost worker to its replacement answering
    "fleet/desired_workers",  # scaling hint for an external autoscaler (moerl.runtime.fleet)
    "env/turns_mean",  # policy turns per episode of the step's samples (task.name env; else null)
    "env/latency_p50_s",  # median environment call latency, recent calls of every worker (moerl.envs)
    "env/latency_p99_s",  # 99th percentile of the same
    "env/errors",  # episodes ended by an environment fault so far: raised, timeout, died, lost (cumulative)
    "env/timeouts",  # environment calls past env.step_timeout_s so far (cumulative)
    "env/parked_max",  # most episodes parked at once on their environments, per worker (max over workers)
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
)
"""Fields that depend on wall-clock time (excluded when comparing two runs for equality)."""


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

    Raises:
        KeyError: ``values`` has a key outside ``METRIC_KEYS``.
        TypeError: a value is not a number or None.
    """
    unknown = sorted(set(values) - set(METRIC_KEYS))
    if unknown:
        raise KeyError(f"metrics outside the fixed schema: {unknown}; allowed: {list(METRIC_KEYS)}")
    record: dict[str, float | int | None] = {"step": int(step), "wall_s": round(float(wall_s), 4)}
    for key in METRIC_KEYS:
        record[key] = _clean(values.get(key))
    return record


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
    """The record minus the fields that depend on wall-clock time (for run-to-run equality)."""
    return {k: v for k, v in record.items() if k not in WALL_KEYS}
