"""Exactly-once task accounting at the end of a run: where every task drawn from the data source ended.

The rollout side reports what its queue and buffer still hold (``FleetState``, from
``Rollouts.final_state``); ``accounting`` sets that against the run's ledger of trained tasks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moerl.rundir.folder import LedgerEntry
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.queue import QueueStats


@dataclass(frozen=True, slots=True)
class FleetState:
    """What the fleet holds at the end of a run (for the exactly-once accounting)."""

    queue: QueueStats
    """Queue counters."""
    buffer: BufferMetrics
    """Buffer counters."""
    queued_task_ids: tuple[str, ...]
    """Tasks pending or leased in the queue."""
    buffered_task_ids: tuple[str, ...]
    """Tasks whose groups are still in the buffer."""
    reward_errors: int
    """Samples whose reward function raised, over all workers."""

    @classmethod
    def from_states(
        cls,
        queue: QueueStats,
        buffer: BufferMetrics,
        queue_state: dict,
        buffer_state: dict,
        reward_errors: int,
    ) -> FleetState:
        """Build it from the counters and the ``state_dict()`` of ``TaskQueue`` and ``ExperienceBuffer``."""
        return cls(
            queue=queue,
            buffer=buffer,
            queued_task_ids=tuple(t["task_id"] for t in queue_state["tasks"]),
            buffered_task_ids=tuple(g["task"]["task_id"] for g in buffer_state["groups"]),
            reward_errors=reward_errors,
        )


def accounting(ledger: list[LedgerEntry], fleet: FleetState) -> dict[str, int]:
    """Exactly-once task accounting from the ledger and the queue/buffer contents.

    Every task drawn from the data source (the queue's cursor) must end in exactly one place:
    trained (ledger), still in the buffer, still pending/leased in the queue, filtered, or dropped
    as stale. ``tasks_duplicated`` counts ledger ids trained more than once plus trained ids that are
    also still queued or buffered; ``tasks_lost`` counts drawn tasks that are in none of the places.
    ``tasks_leased``, ``tasks_acked`` and ``tasks_requeued`` count events, not tasks: a requeued task is
    leased and acked again, so they may exceed ``tasks_drawn`` (``QueueStats``).
    """
    counts = Counter(e.task_id for e in ledger)
    trained = set(counts)
    waiting = set(fleet.queued_task_ids) | set(fleet.buffered_task_ids)
    duplicated = sum(c - 1 for c in counts.values()) + len(trained & waiting)
    accounted = len(trained | waiting) + fleet.queue.filtered + fleet.buffer.dropped_stale
    return {
        "tasks_drawn": fleet.queue.cursor,
        "tasks_leased": fleet.queue.leased,
        "tasks_acked": fleet.queue.acked,
        "tasks_requeued": fleet.queue.requeued,
        "tasks_trained": len(ledger),
        "tasks_filtered": fleet.queue.filtered,
        "tasks_dropped_stale": fleet.buffer.dropped_stale,
        "tasks_waiting": len(waiting),
        "tasks_duplicated": duplicated,
        "tasks_lost": fleet.queue.cursor - accounted,
    }
