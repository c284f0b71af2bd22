"""The rollout side as the run (``moerl.train``) sees it: one declared interface, two implementations.

    trainer --next_groups--> Rollouts --publish--> workers (through the weight transport)
                              (queue -> lease -> generate -> score -> buffer)

- ``LocalRollouts`` (``moerl.runtime.local``, sync mode): queue, buffer and one worker in the driver
  process, generate-then-train, no Ray.
- ``RayRollouts`` (``moerl.runtime.ray``, async mode): the queue and buffer in an exchange actor, N
  rollout worker actors generating while the trainer trains.

Whatever the implementation, the trainer meets the workers only here: through the buffer (groups in),
the queue (tasks back on a trainer restart), the weights (versions out) and the held-out evaluation.
Which one a run gets is its placement's (``moerl.placement.Placement.rollout.runs_on``), started by
``moerl.runtime.start.start_rollouts``; the run never tests which it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moerl.records import Group, RolloutTask
from moerl.rollout.precision_gap import LogprobGap
from moerl.runtime.accounting import FleetState
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.fleet import WorkerRecord
from moerl.runtime.queue import QueueStats
from moerl.runtime.worker import WorkerStats
from moerl.tasks.eval import EvalResult
from moerl.trainer.protocol import Trainer
from moerl.weights.transport import WeightHolder


class Rollouts(Protocol):
    """What the run asks of its rollout side; restored from checkpoint parts when it is built."""

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Take ``n`` scored groups from the buffer (sync: generate them first; async: wait for them).

        Returns:
            ``(groups, generation seconds, seconds waited)``.
        """
        ...

    def publish(
        self,
        trainer: WeightHolder,
        *,
        is_stored: bool = False,
        is_final: bool = False,
        is_durable: bool = False,
    ) -> None:
        """Send ``trainer``'s current version to the workers and advance the buffer's staleness clock to
        it: in process (sync), or through the run's weight transport (``runtime.weight_sync``,
        ``moerl.weights.transport``), which asks the trainer for its buckets or tensors. ``is_stored``:
        the caller already wrote this version to the weight store (trainer recovery), so it is not
        written again; ``is_final``: the run's last version, in the store once this returns
        (``publish`` then ``make_durable``); ``is_durable``: a version the store must get (a
        checkpoint's), like every ``runtime.durable_every``-th: written in the background from a host
        snapshot (``moerl.weights.durable``), never on the step's path.

        Raises:
            WeightWriteError: an earlier background write to the store failed (the run stops, one line).
        """
        ...

    def published_version(self) -> int:
        """The newest policy version sent to the workers (the version the rollouts started at before the
        first ``publish``); a trainer recovery numbers its restored weights past it."""
        ...

    def evaluate(self, trainer: Trainer, prompts: list | None) -> EvalResult:
        """Held-out greedy evaluation of ``trainer``'s current version on ``prompts`` (None: the task's
        main held-out set; ``moerl.tasks.eval.evaluate``): where the placement evaluates
        (``Placement.driver.evaluates_later``), in process on the driver's copy of the policy, brought to
        that version first (``trainer.refresh_model``); else on one rollout worker, the version
        published to the workers first if it was not.

        Raises:
            EvalVersionRefused: every worker tried refused the version (its tensors do not fit).
            RuntimeError: no copy of the policy can evaluate (none in the driver, no worker left).
        """
        ...

    def precision_gap(self, trainer: Trainer, groups: list[Group]) -> LogprobGap | None:
        """The precision probe: the log-prob gap and greedy agreement of the rollout engine's
        lower-precision copy (FP8) against ``trainer``'s policy on ``groups``' samples
        (``moerl.rollout.precision_gap.logprob_gap``, both models re-run, no grad), where the placement
        probes it (``Placement.driver.probes_precision``: the engine and the one-process trainer in the
        driver); None elsewhere."""
        ...

    def engine_model(self) -> torch.nn.Module | None:
        """The rollout engine's model where it is in this process (its own copy of the policy, in
        ``rollout.weight_dtype``); None where the engines run in other processes."""
        ...

    def start_milestones(self) -> dict[str, float]:
        """``time.perf_counter()`` (this process) of each milestone of the rollout side's start, for
        ``summary.json`` ``startup_s``: async ``ray_started`` (Ray connected or started),
        ``workers_spawned`` (worker actors asked for), ``exchange_ready`` (queue and buffer actor up);
        sync: none (its worker is built in process)."""
        ...

    def make_durable(self, trainer: WeightHolder) -> None:
        """Make ``trainer``'s current version, published already, durable: in the weight store once this
        returns (background writes flushed, the version written if no earlier write has). What a run's
        last version needs; a version still being sent to the workers is waited for first."""
        ...

    def requeue(self, task: RolloutTask) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        ...

    def queue_stats(self) -> QueueStats:
        """The task queue's counters."""
        ...

    def buffer_metrics(self) -> BufferMetrics:
        """The experience buffer's counters."""
        ...

    def worker_stats(self) -> list[WorkerStats]:
        """Counters of every live worker."""
        ...

    def fleet_values(self, batch_groups: int) -> dict[str, float]:
        """The step's ``fleet/*`` metrics (workers alive and wanted, interruptions, lost work)."""
        ...

    def worker_records(self) -> list[WorkerRecord]:
        """Every worker seen: its state and last heartbeat (``WorkerHealth``). Read-only, no remote call:
        the metrics endpoint calls it from its own thread at each scrape."""
        ...

    def policy_lags(self) -> dict[str, int]:
        """Worker id -> its policy lag in versions: the trainer's version when the worker's latest
        liveness answer was asked for, minus the engine version in that answer (>= 0; a worker with no
        weights loaded yet is absent). Read-only, no remote call (read at each scrape, like
        ``worker_records``)."""
        ...

    def fleet_summary(self) -> dict:
        """Fleet figures for ``summary.json``."""
        ...

    def state_dict(self) -> dict:
        """Queue and buffer state for a checkpoint (``{"queue": ..., "buffer": ...}``), taken with no
        delivery in progress."""
        ...

    def final_state(self) -> FleetState:
        """Stop generating (unfinished leases go back to the queue) and report what the queue and the
        buffer still hold, for the exactly-once accounting."""
        ...

    def close(self) -> None:
        """Stop every worker and release the rollout side's resources (idempotent)."""
        ...
