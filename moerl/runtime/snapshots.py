"""Progress snapshots: a rollout worker's in-flight sequences copied to the exchange, off the decode path.

A worker lost without a notice (SIGKILL, kernel panic, a Spot reclaim that beats its notice, a node off
the network) cannot hand its generated prefixes back as a drain does. So each worker runs a
``SnapshotSender``: a daemon thread (``moerl-snapshot-<worker id>``) that every ``poll_s`` seconds reads
the worker's progress (``RolloutWorker.in_flight``: host copies of each running sequence's token ids,
log-probs and per-token policy versions; safe from another thread) and, when one sequence of a group has
``every_tokens`` more tokens than in the group's last snapshot, sends the group's new tokens to the
exchange (``TaskQueue.save_progress``, which appends them to what the lease's earlier snapshots left:
each token crosses the network once; after a refused snapshot the whole prefixes are sent again). All
groups due at one look go in one call (batched); the decode loop never waits for it: the decode thread
does no snapshot work at all (this thread reads what the engine already synced to the host).

The exchange runs on a node of the ``exchange`` group or the driver's, never on a ``rollout``/Spot node
(``moerl.cluster.placement``), so a snapshot outlives the worker that sent it. When the worker's leases
expire, the queue puts each task back with its snapshot as ``partial``; the next worker re-prefills
prompt + kept tokens and continues (``moerl.runtime.drain.ResumePlan``). Fencing is the queue's: a
snapshot under a lease that is no longer current is refused, and so is a late delivery.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moerl.records import LeaseSnapshot, PartialResponse
from moerl.runtime.drain import InFlightGroup

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SnapshotStats:
    """Counters of one ``SnapshotSender`` (cumulative)."""

    looks: int = 0
    """Times the thread read the worker's progress."""
    sends: int = 0
    """Calls to the exchange (each a batch of groups)."""
    snapshots: int = 0
    """Group snapshots sent."""
    snapshots_kept: int = 0
    """Group snapshots the exchange kept (the others' leases were gone)."""
    bytes_sent: int = 0
    """Bytes sent, as the pickled size of each batch (what a Ray call carries)."""
    tokens_sent: int = 0
    """Response tokens in the snapshots sent (the new ones since the group's last kept snapshot)."""
    cpu_s: float = 0.0
    """CPU seconds the looks took (``time.thread_time`` of the thread that ran them: reading the
    progress, building and pickling the batch, the call); with the GIL, an upper bound on the time they
    could take from the decode thread."""
    errors: int = 0
    """Sends that raised (logged; the next look tries again)."""


class SnapshotSender:
    """Sends a worker's progress to the exchange from its own thread (module docstring).

    Args:
        worker_id: names the thread ``moerl-snapshot-<worker_id>``.
        progress: the worker's ``in_flight`` (list of ``InFlightGroup``); called on this thread.
        sink: ``save_progress(list[LeaseSnapshot]) -> int`` kept: the queue, or the exchange's proxy.
        every_tokens: a group is due once one of its sequences grew by this many tokens (>= 1).
        poll_s: seconds between looks.

    Raises:
        ValueError: ``every_tokens`` < 1 or ``poll_s`` <= 0.
    """

    def __init__(
        self,
        worker_id: str,
        progress: Callable[[], list[InFlightGroup]],
        sink: Callable[[list[LeaseSnapshot]], int],
        *,
        every_tokens: int,
        poll_s: float = 0.25,
    ) -> None:
        if every_tokens < 1:
            raise ValueError(f"SnapshotSender: every_tokens={every_tokens} must be >= 1")
        if poll_s <= 0:
            raise ValueError(f"SnapshotSender: poll_s={poll_s} must be > 0 seconds")
        self.worker_id = worker_id
        self.progress = progress
        self.sink = sink
        self.every_tokens = every_tokens
        self.poll_s = poll_s
        self.stats = SnapshotStats()
        self._sent: dict[int, dict[int, int]] = {}  # lease token -> sample index -> tokens at the exchange
        self._sent_tokens: dict[int, int] = {}  # lease token -> tokens of its last kept snapshot
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one look at a time (the thread's, or a ``flush``)
        self._thread = threading.Thread(target=self._loop, name=f"moerl-snapshot-{worker_id}", daemon=True)

    def start(self) -> SnapshotSender:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (after its current look)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def flush(self) -> int:
        """Look now and send every group due (on the caller's thread: a drain's start). Returns the
        snapshots sent."""
        return self._look()

    @property
    def tokens_covered(self) -> int:
        """Response tokens held at the exchange in this worker's newest kept snapshots of the leases it
        still works on: what a hard loss now would not discard."""
        return sum(self._sent_tokens.values())

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._look()

    def _look(self) -> int:
        with self._lock:
            cpu0 = time.thread_time()
            try:
                return self._look_locked()
            finally:
                self.stats.cpu_s += time.thread_time() - cpu0

    def _look_locked(self) -> int:
        self.stats.looks += 1
        groups = self.progress()
        self._forget_gone({g.lease.token for g in groups})
        due = [g for g in groups if self._is_due(g)]
        if not due:
            return 0
        batch = [self._delta(g) for g in due]
        try:
            kept = self.sink(batch)
        except Exception as e:  # the exchange unreachable for now: the next look tries again
            self.stats.errors += 1
            log.warning("worker %s: progress snapshot not sent: %s", self.worker_id, e)
            return 0
        self._record(batch, due, kept)
        return len(batch)

    def _delta(self, g: InFlightGroup) -> LeaseSnapshot:
        """The group's tokens the exchange does not hold yet, per sample from where it left off."""
        held = self._sent.get(g.lease.token, {})
        pieces, offsets = [], []
        for p in g.prefixes:
            start = held.get(p.sample_index, 0)
            start = start if start <= len(p.response_ids) else 0
            if start == len(p.response_ids) and start:
                continue  # nothing new for this sample
            pieces.append(
                PartialResponse(
                    p.sample_index,
                    p.response_ids[start:],
                    p.response_logprobs[start:],
                    p.policy_versions[start:],
                )
            )
            offsets.append(start)
        return LeaseSnapshot(g.lease.task_id, g.lease.token, pieces, offsets)

    def _is_due(self, g: InFlightGroup) -> bool:
        last = self._sent.get(g.lease.token, {})
        return any(len(p.response_ids) - last.get(p.sample_index, 0) >= self.every_tokens for p in g.prefixes)

    def _record(self, batch: Sequence[LeaseSnapshot], due: Sequence[InFlightGroup], kept: int) -> None:
        s = self.stats
        s.sends += 1
        s.snapshots += len(batch)
        s.snapshots_kept += int(kept)
        s.bytes_sent += len(pickle.dumps(list(batch), protocol=pickle.HIGHEST_PROTOCOL))
        s.tokens_sent += sum(b.num_tokens for b in batch)
        for g in due:
            if kept == len(batch):  # all held at the exchange: the next ones are deltas on them
                self._sent[g.lease.token] = {p.sample_index: len(p.response_ids) for p in g.prefixes}
                self._sent_tokens[g.lease.token] = g.num_tokens
            else:  # which one was refused is not known: whole prefixes next time
                self._sent.pop(g.lease.token, None)
                self._sent_tokens.pop(g.lease.token, None)

    def _forget_gone(self, live: set[int]) -> None:
        for token in [t for t in self._sent if t not in live]:
            del self._sent[token]
            self._sent_tokens.pop(token, None)
