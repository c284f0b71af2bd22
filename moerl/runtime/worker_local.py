"""The in-process side of the rollout worker: the sync-mode fleet and the weight sources.

``LocalFleet`` runs the queue, the buffer and one ``RolloutWorker`` in this process (sync mode,
generate-then-train); ``LocalWeights`` hands the trainer's weights over in process; ``StoreWeights``
polls a ``WeightStore`` (a Ray worker's fallback when no weights were offered through the object store).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from moerl.runtime.fleet import WorkerHealth, WorkerRecord, WorkerState

if TYPE_CHECKING:
    from moerl.runtime.types import Group
    from moerl.runtime.worker import RolloutWorker, WorkerStats


class LocalWeights:
    """In-process weight hand-off (sync mode): the trainer ``push``es, workers ``poll``."""

    def __init__(self) -> None:
        self.version = -1
        self.tensors: Mapping[str, torch.Tensor] = {}

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Offer ``tensors`` as ``version`` (copied by the engine on its next poll)."""
        self.version, self.tensors = version, tensors

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The pushed weights if newer than ``version``."""
        return (self.version, self.tensors) if self.version > version else None


class StoreWeights:
    """Polls a ``WeightStore`` for a newer complete version, at most once per ``interval_s``."""

    def __init__(self, store, interval_s: float = 0.5) -> None:
        self.store = store
        self.interval_s = interval_s
        self._next_check = 0.0

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The newest stored version's tensors if it is newer than ``version`` (checksums verified)."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.interval_s
        latest = self.store.latest()
        if latest is None or latest.version <= version:
            return None
        loaded = self.store.load_latest()
        return None if loaded is None else (loaded[0].version, loaded[1])


class LocalFleet:
    """The sync-mode runtime: queue, buffer and one worker in this process, generate-then-train.

    ``next_groups(n)`` has the worker generate exactly ``n`` groups at the current weights and takes
    them from the buffer (max_staleness 0: on-policy). The async counterpart is
    ``moerl.runtime.actors.RayFleet``; both offer ``next_groups``, ``push_weights``, ``queue_stats``,
    ``buffer_metrics``, ``state_dict``/``load_state_dict``, ``worker_stats`` and ``close``.
    """

    def __init__(self, queue, buffer, worker: RolloutWorker, weights: LocalWeights):
        self.queue, self.buffer, self.worker, self.weights = queue, buffer, worker, weights

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Generate ``n`` groups and take them from the buffer.

        Returns:
            ``(groups, generation seconds, wait seconds)``; the wait is 0 in sync mode.
        """
        start = time.perf_counter()
        while self.buffer.metrics().depth < n:
            self.worker.run(num_groups=n - self.buffer.metrics().depth)
        gen_s = time.perf_counter() - start
        return self.buffer.get(n, timeout=0), gen_s, 0.0

    def push_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand the trainer's new weights to the worker and advance the staleness clock."""
        self.weights.push(version, tensors)
        self.buffer.set_version(version)

    def queue_stats(self):
        """``TaskQueue.stats()``."""
        return self.queue.stats()

    def buffer_metrics(self):
        """``ExperienceBuffer.metrics()``."""
        return self.buffer.metrics()

    def worker_stats(self) -> list[WorkerStats]:
        """Counters of every worker."""
        return [self.worker.stats]

    def requeue(self, task) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        self.queue.requeue(task)

    def fleet_values(self, batch_groups: int) -> dict:
        """The step's ``fleet/*`` metrics: one in-process worker, never interrupted."""
        never = dict.fromkeys(
            ("fleet/interruptions", "fleet/drained", "fleet/killed", "fleet/lost_work_frac"), 0
        )
        return {**never, "fleet/workers_alive": 1, "fleet/desired_workers": 1}

    def worker_records(self) -> list:
        """A ``WorkerRecord`` of the in-process worker (always alive), as ``RayFleet`` reports its workers."""
        stats = self.worker.stats
        health = WorkerHealth(
            tokens_delivered=stats.tokens_generated,
            groups_delivered=stats.groups_put,
            policy_version=self.worker.version,
        )
        return [WorkerRecord(self.worker.worker_id, 0.0, WorkerState.ALIVE, health=health)]

    def fleet_summary(self) -> dict:
        """Fleet figures for ``summary.json`` (nothing to report in-process)."""
        return {}

    def state_dict(self) -> dict:
        """Queue and buffer state (the worker is idle between sync steps)."""
        return {"queue": self.queue.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` into the fresh queue and buffer."""
        self.queue.load_state_dict(state["queue"])
        self.buffer.load_state_dict(state["buffer"])

    def final_state(self):
        """``FleetState`` for the run's accounting."""
        from moerl.runtime.setup import FleetState

        return FleetState.from_states(
            self.queue.stats(),
            self.buffer.metrics(),
            self.queue.state_dict(),
            self.buffer.state_dict(),
            self.worker.stats.reward_errors,
        )

    def close(self) -> None:
        """Nothing to stop in-process."""
