"""Leased task queue: prompts become tasks, workers lease them, fencing tokens make delivery exactly-once.

Life of a task (one prompt x n samples, one GRPO group)::

    source --draw--> pending --lease--> leased --ack / settle(admitted|filtered|dropped_stale)--> done
                        ^                  |
                        +------------------+  release, lease expiry, settle(requeued_stale)
                        ^
                        +-- requeue(task): a done task whose group later went stale in the buffer

Progress snapshots (``save_progress``): a worker sends the generated prefixes of its leased groups now
and then; the queue keeps the newest one per current lease only (a settled, released or expired lease
drops it), so its memory is bounded by the leased tasks. When a lease *expires* (its worker lost without
a notice: SIGKILL, node gone) the snapshot becomes the task's ``partial`` and the next worker continues
it (``moerl.runtime.drain.ResumePlan``); a ``release`` carries its own prefixes instead.

Each lease carries a fencing token, strictly increasing over the queue's life (and across a resume). A
task has at most one current token; ack, release, heartbeat and settle act only when the token they carry
is the current one, so a slow worker that delivers after its lease expired (and the task was leased again)
is refused. Leases are checked for expiry lazily at the start of every call, against an injectable clock.

Refusals are not exceptions: ``ack``/``release``/``settle``/``validate`` return ``False`` and
``heartbeat`` returns no renewed lease; the caller drops its work. All methods are thread-safe (one lock),
so a Ray actor may serve them concurrently.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from moerl.records import (
    Lease,
    LeaseSnapshot,
    PartialResponse,
    RolloutTask,
    Settlement,
    append_prefixes,
    merge_prefixes,
)

_FORMAT = "moerl-queue/1"


class PromptLike(Protocol):
    """What the queue reads from its source: ``moerl.tasks.Prompt`` has these attributes."""

    id: str
    text: str
    answer: str
    extra: dict | None  # the row's columns for an ``extra=`` reward (``moerl.tasks.Prompt.extra``)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counters of a ``TaskQueue`` (cumulative since the start of the run, resumes included)."""

    leased: int
    """Leases granted (a task leased twice counts twice)."""
    acked: int
    """Acks for training: ``ack`` calls plus ``settle(ADMITTED)``. A task whose admitted group went stale in
    the buffer (or whose training a trainer restart lost) is ``requeue``-d and acked again, so ``acked`` may
    exceed the tasks drawn; the exactly-once check is the ledger's (``accounting``), not this counter."""
    filtered: int
    """Tasks settled as ``FILTERED`` (done, not trained)."""
    dropped_stale: int
    """Tasks settled as ``DROPPED_STALE`` (done, not trained)."""
    requeued: int
    """Returns to pending for any reason: released + expired + requeued_stale + leases open at a resume."""
    released: int
    """Leases handed back by ``release``."""
    expired: int
    """Leases that expired (worker lost or too slow)."""
    requeued_stale: int
    """Tasks handed back because their group was too stale (``settle(REQUEUED_STALE)`` or ``requeue``)."""
    refused: int
    """Acks and settlements refused because their token was not current."""
    outstanding: int
    """Tasks leased right now."""
    pending: int
    """Materialized tasks waiting to be leased (not counting prompts not yet drawn)."""
    cursor: int
    """Prompts drawn from the source so far (the data cursor)."""
    is_exhausted: bool
    """The source has no more prompts and no task is pending or leased."""
    snapshots_saved: int = 0
    """Progress snapshots kept (``save_progress`` under a current lease)."""
    snapshots_refused: int = 0
    """Progress snapshots refused: their lease was no longer current."""
    snapshot_tokens_held: int = 0
    """Response tokens held in snapshots right now (newest per current lease only)."""
    tokens_restored: int = 0
    """Response tokens handed from snapshots to tasks whose lease expired (continued by the next worker)."""


@dataclass(slots=True)
class _Entry:
    task: RolloutTask  # attempt = leases so far
    lease: Lease | None = None
    ttl_s: float = 0.0
    snapshot: tuple[PartialResponse, ...] = ()  # newest progress under the current lease


def _task_to_dict(task: RolloutTask) -> dict[str, Any]:
    """JSON-serialisable form; ``RolloutTask(**data)`` inverts it."""
    data = dataclasses.asdict(task)
    data["prompt_ids"] = list(task.prompt_ids)
    data["partial"] = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()} for p in data["partial"]
    ]
    return data


class TaskQueue:
    """Hands out tasks under leases with fencing tokens; see the module docstring for the protocol.

    Args:
        prompts: iterable of prompts (``.id``, ``.text`` already templated, ``.answer``); may be endless.
            Drawn lazily, one per task, in order.
        num_samples: group size n of every task.
        tokenize: ``text -> token ids`` used to build ``RolloutTask.prompt_ids``.
        max_materialized: most tasks held at once (pending + leased); ``lease`` returns fewer tasks than
            asked when the bound is reached. Must be >= 1.
        clock: time source in seconds for lease expiry; ``time.monotonic`` by default, injectable in tests.

    Raises:
        ValueError: ``num_samples`` or ``max_materialized`` < 1.
    """

    def __init__(
        self,
        prompts: Iterable[PromptLike],
        *,
        num_samples: int,
        tokenize: Callable[[str], Sequence[int]],
        max_materialized: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"TaskQueue: num_samples={num_samples} must be >= 1")
        if max_materialized < 1:
            raise ValueError(f"TaskQueue: max_materialized={max_materialized} must be >= 1")
        self._source = iter(prompts)
        self._num_samples = num_samples
        self._tokenize = tokenize
        self._max_materialized = max_materialized
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._pending: collections.deque[str] = collections.deque()
        self._cursor = 0
        self._source_done = False
        self._last_token = 0
        self._counts = collections.Counter()
        self._restored: dict[str, int] = {}  # worker id -> tokens restored from its snapshots

    # -- worker side ---------------------------------------------------------------------------

    def lease(self, worker_id: str, ttl_s: float, max_tasks: int = 1) -> list[Lease]:
        """Lease up to ``max_tasks`` tasks to ``worker_id`` for ``ttl_s`` seconds.

        Requeued tasks come first, then new prompts from the source, in order. Returns an empty list when
        nothing is available (source exhausted, or ``max_materialized`` tasks are already leased).

        Raises:
            ValueError: ``ttl_s`` <= 0 or ``max_tasks`` < 1.
        """
        if ttl_s <= 0:
            raise ValueError(f"TaskQueue.lease: ttl_s={ttl_s} must be > 0 seconds")
        if max_tasks < 1:
            raise ValueError(f"TaskQueue.lease: max_tasks={max_tasks} must be >= 1")
        with self._lock:
            now = self._reap_locked()
            leases = []
            while len(leases) < max_tasks:
                entry = self._next_pending_locked()
                if entry is None:
                    break
                self._last_token += 1
                entry.task = dataclasses.replace(entry.task, attempt=entry.task.attempt + 1)
                entry.lease = Lease(entry.task, worker_id, self._last_token, now + ttl_s)
                entry.ttl_s = ttl_s
                leases.append(entry.lease)
            self._counts["leased"] += len(leases)
            return leases

    def heartbeat(self, target: Lease | str, ttl_s: float | None = None) -> list[Lease]:
        """Renew one lease (``target`` a ``Lease``) or all leases of a worker (``target`` a worker id).

        Each renewed lease expires ``ttl_s`` seconds from now (default: the ttl it was leased with).
        Returns the renewed leases with their new ``expires_at``; a lease that is missing from the result
        was lost (expired, released or settled) and its work should be abandoned.
        """
        with self._lock:
            now = self._reap_locked()
            renewed = []
            for entry in self._entries.values():
                lease = entry.lease
                if lease is None:
                    continue
                if (
                    (lease.token == target.token)
                    if isinstance(target, Lease)
                    else (lease.worker_id == target)
                ):
                    entry.lease = dataclasses.replace(lease, expires_at=now + (ttl_s or entry.ttl_s))
                    renewed.append(entry.lease)
            return renewed

    def release(self, lease: Lease, *, partial: Sequence[PartialResponse] = ()) -> bool:
        """Hand a leased task back to the front of the queue (a draining worker, or one giving up).

        Args:
            lease: the lease to end.
            partial: response prefixes generated so far, stored on the task (replacing older ones) for the
                next worker to continue; empty: the next worker starts over.

        Returns:
            ``True`` if released now; ``False`` if the lease was not current (idempotent, no effect).
        """
        with self._lock:
            self._reap_locked()
            entry = self._current_entry_locked(lease.task_id, lease.token)
            if entry is None:
                return False
            entry.task = dataclasses.replace(entry.task, partial=tuple(partial))
            self._return_locked(entry, "released")
            return True

    def save_progress(self, snapshots: Sequence[LeaseSnapshot]) -> int:
        """Keep each snapshot whose lease is current: its pieces appended to what the lease's earlier
        snapshots left (``LeaseSnapshot.offsets``; a piece at offset 0 replaces a shorter prefix).

        Returns:
            How many were kept; the others' leases were expired, released or settled, or their offsets do
            not continue what is held (counted as refused; the sender then resends whole prefixes).
        """
        kept = 0
        with self._lock:
            self._reap_locked()
            for snap in snapshots:
                entry = self._current_entry_locked(snap.task_id, snap.lease_token)
                if entry is None:
                    continue
                held = append_prefixes(entry.snapshot, snap.prefixes, snap.offsets)
                if held is None:
                    continue
                entry.snapshot = held
                kept += 1
            self._counts["snapshots_saved"] += kept
            self._counts["snapshots_refused"] += len(snapshots) - kept
        return kept

    def expire_worker(self, worker_id: str) -> int:
        """Expire every lease of ``worker_id`` now (it was lost); their tasks go back to the queue with
        their newest snapshots. Returns the tokens restored from snapshots of this worker's leases over
        the queue's life (this call's and earlier expiries')."""
        with self._lock:
            self._reap_locked()
            mine = [
                e for e in self._entries.values() if e.lease is not None and e.lease.worker_id == worker_id
            ]
            for entry in sorted(mine, key=lambda e: e.lease.token, reverse=True):
                self._return_locked(entry, "expired")
            return self._restored.get(worker_id, 0)

    # -- buffer side ---------------------------------------------------------------------------

    def validate(self, lease: Lease) -> bool:
        """Whether ``lease`` is still the current, unexpired lease of its task (read-only)."""
        return self.is_current(lease.task_id, lease.token)

    def is_current(self, task_id: str, token: int) -> bool:
        """Whether ``token`` is the current, unexpired lease token of ``task_id`` (read-only)."""
        with self._lock:
            self._reap_locked()
            return self._current_entry_locked(task_id, token) is not None

    def settle(self, task_id: str, token: int, outcome: Settlement) -> bool:
        """Atomically check the token and record what became of the task's group.

        ``ADMITTED``, ``FILTERED`` and ``DROPPED_STALE`` finish the task; ``REQUEUED_STALE`` puts it back to
        the front of the queue. The buffer calls this once per delivered group, which makes token check and
        ack one step (no window in which the lease can expire between them).

        Returns:
            ``True`` if recorded; ``False`` if ``token`` is not the task's current lease token (stale or
            unknown task), counted as ``refused``.
        """
        outcome = Settlement(outcome)
        with self._lock:
            self._reap_locked()
            entry = self._current_entry_locked(task_id, token)
            if entry is None:
                self._counts["refused"] += 1
                return False
            if outcome is Settlement.REQUEUED_STALE:  # its kept prefix is what made it stale: start over
                entry.task = dataclasses.replace(entry.task, partial=())
                self._return_locked(entry, "requeued_stale")
            else:
                del self._entries[task_id]
                self._counts["acked" if outcome is Settlement.ADMITTED else outcome.value] += 1
            return True

    def requeue(self, task: RolloutTask) -> None:
        """Put a finished task back to the front of the queue (its admitted group went stale in the buffer,
        or its training was lost with a trainer restart), without its kept prefixes: it starts over.

        Raises:
            ValueError: the task is still pending or leased here (requeuing it would duplicate it).
        """
        with self._lock:
            self._reap_locked()
            if task.task_id in self._entries:
                raise ValueError(f"TaskQueue.requeue: task {task.task_id!r} is still pending or leased")
            self._entries[task.task_id] = _Entry(dataclasses.replace(task, partial=()))
            self._pending.appendleft(task.task_id)
            self._counts["requeued"] += 1
            self._counts["requeued_stale"] += 1

    def stats(self) -> QueueStats:
        """Counters and depths, after expiring overdue leases."""
        with self._lock:
            self._reap_locked()
            c = self._counts
            return QueueStats(
                leased=c["leased"],
                acked=c["acked"],
                filtered=c["filtered"],
                dropped_stale=c["dropped_stale"],
                requeued=c["requeued"],
                released=c["released"],
                expired=c["expired"],
                requeued_stale=c["requeued_stale"],
                refused=c["refused"],
                outstanding=len(self._entries) - len(self._pending),
                pending=len(self._pending),
                cursor=self._cursor,
                is_exhausted=self._source_done and not self._entries,
                snapshots_saved=c["snapshots_saved"],
                snapshots_refused=c["snapshots_refused"],
                snapshot_tokens_held=sum(
                    len(p.response_ids) for e in self._entries.values() for p in e.snapshot
                ),
                tokens_restored=c["tokens_restored"],
            )

    # -- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: data cursor, last token, counters, and the pending then leased tasks.

        Leased tasks are saved as pending (with their attempt count and their newest snapshot as
        ``partial``): on resume they are leased again and continued.
        """
        with self._lock:
            self._reap_locked()
            leased = sorted(
                (e for e in self._entries.values() if e.lease is not None), key=lambda e: e.lease.token
            )
            tasks = [self._entries[t].task for t in self._pending] + [
                dataclasses.replace(e.task, partial=merge_prefixes(e.task.partial, e.snapshot))
                for e in leased
            ]
            return {
                "format": _FORMAT,
                "cursor": self._cursor,
                "source_done": self._source_done,
                "last_token": self._last_token,
                "counts": dict(self._counts),
                "tasks": [_task_to_dict(t) for t in tasks],
                "num_leased": len(leased),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` into a freshly built queue whose source starts at the first prompt.

        Skips ``cursor`` prompts of the source, restores counters and tasks; tasks that were leased become
        pending (counted as requeued). New tokens continue above the saved last token.

        Raises:
            RuntimeError: the queue was already used.
            ValueError: unknown format, or the source has fewer than ``cursor`` prompts.
        """
        if state.get("format") != _FORMAT:
            raise ValueError(
                f"TaskQueue.load_state_dict: unknown format {state.get('format')!r}; expected {_FORMAT!r}"
            )
        with self._lock:
            if self._cursor or self._entries or self._last_token:
                raise RuntimeError(
                    "TaskQueue.load_state_dict needs a fresh queue (no task drawn or leased yet)"
                )
            for i in range(state["cursor"]):
                try:
                    next(self._source)
                except StopIteration:
                    raise ValueError(
                        f"TaskQueue.load_state_dict: the source ended after {i} prompts; the saved cursor is "
                        f"{state['cursor']} (is it the same dataset and seed?)"
                    ) from None
            self._cursor = state["cursor"]
            self._source_done = state["source_done"]
            self._last_token = state["last_token"]
            self._counts = collections.Counter(state["counts"])
            self._counts["requeued"] += state["num_leased"]
            for data in state["tasks"]:
                task = RolloutTask(**data)
                self._entries[task.task_id] = _Entry(task)
                self._pending.append(task.task_id)

    # -- internals (caller holds the lock) -----------------------------------------------------

    def _reap_locked(self) -> float:
        now = self._clock()
        expired = [e for e in self._entries.values() if e.lease is not None and now >= e.lease.expires_at]
        for entry in sorted(expired, key=lambda e: e.lease.token, reverse=True):
            self._return_locked(entry, "expired")  # appendleft in reverse: oldest lease ends up first
        return now

    def _return_locked(self, entry: _Entry, reason: str) -> None:
        if reason == "expired" and entry.snapshot:  # a lost worker: its newest progress is continued
            num = sum(len(p.response_ids) for p in entry.snapshot)
            entry.task = dataclasses.replace(
                entry.task, partial=merge_prefixes(entry.task.partial, entry.snapshot)
            )
            worker = entry.lease.worker_id
            self._restored[worker] = self._restored.get(worker, 0) + num
            self._counts["tokens_restored"] += num
        entry.snapshot = ()
        entry.lease = None
        self._pending.appendleft(entry.task.task_id)
        self._counts[reason] += 1
        self._counts["requeued"] += 1

    def _current_entry_locked(self, task_id: str, token: int) -> _Entry | None:
        entry = self._entries.get(task_id)
        if entry is None or entry.lease is None or entry.lease.token != token:
            return None
        return entry

    def _next_pending_locked(self) -> _Entry | None:
        if self._pending:
            return self._entries[self._pending.popleft()]
        if self._source_done or len(self._entries) >= self._max_materialized:
            return None
        try:
            prompt = next(self._source)
        except StopIteration:
            self._source_done = True
            return None
        task = RolloutTask(
            task_id=f"{self._cursor}:{prompt.id}",
            prompt_ids=tuple(self._tokenize(prompt.text)),
            prompt_text=prompt.text,
            answer=prompt.answer,
            num_samples=self._num_samples,
            extra=getattr(prompt, "extra", None),
        )
        self._cursor += 1
        if task.task_id in self._entries:  # pragma: no cover - the cursor makes ids unique
            raise RuntimeError(f"duplicate task id {task.task_id!r}")
        self._entries[task.task_id] = _Entry(task)
        return self._entries[task.task_id]
