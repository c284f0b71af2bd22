"""The run's ``worker_*`` start milestones: the worker whose groups made up the first batch, stamped when its
first delivery left it (``RolloutWorker._deliver``), chosen by ``Run._note_worker_startup``."""

from __future__ import annotations

from types import SimpleNamespace

from moerl.runtime.worker import WorkerStats
from moerl.train import Run


def _stats(worker_id: str, first_put: float | None) -> WorkerStats:
    s = WorkerStats(worker_id=worker_id)
    s.startup.update(init=1.0, policy_loaded=2.0, ready=3.0)
    if first_put is not None:
        s.startup["first_put"] = first_put
    return s


def _run(first_workers: set[str]) -> SimpleNamespace:
    return SimpleNamespace(startup={}, wall_start=0.0, _first_workers=first_workers)


def test_the_milestones_are_of_a_worker_of_the_first_batch_not_the_earliest_put():
    # "a" handed groups over first, but none of them made the first batch (refused as stale, say)
    run = _run({"b"})
    Run._note_worker_startup(run, [_stats("a", 4.0), _stats("b", 6.0)])
    assert run.startup == {
        "worker_init": 1.0,
        "worker_policy_loaded": 2.0,
        "worker_ready": 3.0,
        "worker_first_put": 6.0,
    }


def test_a_first_batch_worker_that_did_not_answer_is_asked_again():
    # its stats were missing at the first step (lost or unreachable): nothing recorded, not another worker's
    run = _run({"b"})
    Run._note_worker_startup(run, [_stats("a", 9.0)])
    assert run.startup == {}
    Run._note_worker_startup(run, [_stats("a", 9.0), _stats("b", 5.0)])
    assert run.startup["worker_first_put"] == 5.0
