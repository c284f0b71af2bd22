"""TaskQueue under concurrent workers: no task held twice, every task acked exactly once."""

import random
import sys
import threading
from collections import Counter, namedtuple

from moerl.runtime import Settlement, TaskQueue


def ack(q, lease) -> bool:
    """What the buffer's ``put`` does for a delivered group: settle the lease as admitted."""
    return q.settle(lease.task_id, lease.token, Settlement.ADMITTED)


Prompt = namedtuple("Prompt", "id text answer")
NUM_TASKS = 300
NUM_WORKERS = 8
TTL_S = 5.0


class SharedClock:
    """A clock that worker threads push forward to make leases expire at random moments."""

    def __init__(self):
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def test_lease_protocol_under_races():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that calls interleave
    try:
        _run_race()
    finally:
        sys.setswitchinterval(previous)


def _run_race():
    clock = SharedClock()
    q = TaskQueue(
        [Prompt(f"p{i}", "x", "0") for i in range(NUM_TASKS)],
        num_samples=2,
        tokenize=lambda s: [1],
        max_materialized=16,
        clock=clock,
    )
    held: dict[str, list] = {f"w{i}": [] for i in range(NUM_WORKERS)}  # leases a worker believes it holds
    held_lock = threading.Lock()
    successful_acks: list[tuple[str, int]] = []
    violations: list[str] = []
    stop = threading.Event()

    def worker(worker_id: str, seed: int) -> None:
        rng = random.Random(seed)
        late: list = []  # leases this worker stalled on; it delivers them after others may have re-leased
        while not q.stats().is_exhausted:
            leases = q.lease(worker_id, TTL_S, max_tasks=2)  # may re-lease a task of ``late``
            for lease in late:
                if ack(q, lease):
                    violations.append(f"late ack after expiry accepted: {lease}")
            late.clear()
            with held_lock:
                held[worker_id] = list(leases)
            for lease in leases:
                action = rng.random()
                if action < 0.7:
                    if ack(q, lease):
                        successful_acks.append((lease.task_id, lease.token))
                elif action < 0.85:
                    q.release(lease)
                    if q.release(lease):
                        violations.append(f"second release of {lease} succeeded")
                else:
                    clock.advance(TTL_S)  # this worker stalls past its lease
                    late.append(lease)
            with held_lock:
                held[worker_id] = []

    def checker() -> None:
        # Tokens only grow, so checking newest first is sound: if a newer lease is current and an older
        # one of the same task is current after it, two workers held the task at the same time.
        while not stop.is_set():
            with held_lock:
                snapshot = [lease for leases in held.values() for lease in leases]
            current = Counter()
            for lease in sorted(snapshot, key=lambda x: -x.token):
                if q.validate(lease):
                    current[lease.task_id] += 1
            violations.extend(f"task {t} held {n} times" for t, n in current.items() if n > 1)

    threads = [threading.Thread(target=worker, args=(w, i)) for i, w in enumerate(held)]
    check = threading.Thread(target=checker)
    check.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    check.join(timeout=10)

    assert violations == []
    acked_ids = Counter(task_id for task_id, _ in successful_acks)
    assert len(acked_ids) == NUM_TASKS and set(acked_ids.values()) == {1}  # every task exactly once
    s = q.stats()
    assert s.acked == NUM_TASKS and s.outstanding == 0 and s.pending == 0
    # every lease ended exactly one way
    assert s.leased == s.acked + s.released + s.expired
    assert s.requeued == s.released + s.expired
    assert s.expired > 0 and s.released > 0
