"""Trainer restart bookkeeping: step journal, requeue of lost steps' tasks, monotonic versions, ledger."""

import pytest

from moerl.records import Settlement
from moerl.run.recovery import StepJournal, restart_trainer
from moerl.runtime.queue import TaskQueue
from moerl.tasks import Prompt


def _queue():
    prompts = (Prompt(id=f"p{i}", text=f"{i}+1=", answer=str(i + 1)) for i in range(100))
    return TaskQueue(prompts, num_samples=2, tokenize=lambda s: [ord(c) % 50 for c in s])


def _train_steps(queue, journal, ledger, steps, per_step=2):
    """Lease, settle (the buffer's ack) and 'train' ``per_step`` tasks per step, journaling them."""
    for step in steps:
        leases = queue.lease("w0", ttl_s=100.0, max_tasks=per_step)
        for lease in leases:
            assert queue.settle(lease.task_id, lease.token, Settlement.ADMITTED)
        journal.record(step, [lease.task for lease in leases])
        ledger += [(lease.task_id, step) for lease in leases]


def test_journal_commit_and_rollback():
    journal = StepJournal()
    for s in (1, 2, 3):
        journal.record(s, [])
    with pytest.raises(ValueError, match="already recorded"):
        journal.record(2, [])
    journal.commit(1)
    assert journal.steps == [2, 3]
    assert journal.rollback(2) == [] and journal.steps == [2]


def test_restart_requeues_lost_steps_and_every_task_is_trained_once():
    queue, journal, ledger = _queue(), StepJournal(), []
    _train_steps(queue, journal, ledger, [1, 2])
    journal.commit(2)  # full checkpoint after step 2
    _train_steps(queue, journal, ledger, [3, 4, 5])  # the trainer dies after step 5
    lost_ids = [t for t, s in ledger if s > 2]

    def rewind(step):
        ledger[:] = [(t, s) for t, s in ledger if s <= step]

    report, offset = restart_trainer(
        failed_step=5, load=lambda: 2, journal=journal, requeue=queue.requeue, rewind=rewind, newest_version=5
    )
    assert (report.failed_step, report.restored_step, report.tasks_requeued) == (5, 2, 6)
    # restored weights published as version 6; the next step (3) is version 3 + 4 = 7
    assert (report.version, offset) == (6, 4)
    assert [t for t, _ in ledger] == [t for t, s in ledger if s <= 2] and len(ledger) == 4
    # the lost steps' tasks come back first, then training continues from step 3
    leases = queue.lease("w1", ttl_s=100.0, max_tasks=6)
    assert sorted(lease.task_id for lease in leases) == sorted(lost_ids)
    for lease in leases:
        queue.settle(lease.task_id, lease.token, Settlement.ADMITTED)
    ledger += [(lease.task_id, 3 + i // 2) for i, lease in enumerate(leases)]
    ids = [t for t, _ in ledger]
    assert len(ids) == len(set(ids)) == queue.stats().cursor == 10  # none lost, none duplicated
    assert queue.stats().requeued == 6


def test_restart_without_checkpoint_starts_over_and_rejects_future_checkpoint():
    queue, journal, ledger = _queue(), StepJournal(), []
    _train_steps(queue, journal, ledger, [1])
    report, offset = restart_trainer(
        failed_step=1,
        load=lambda: 0,
        journal=journal,
        requeue=queue.requeue,
        rewind=lambda s: ledger.clear(),
        newest_version=1,
    )
    assert (report.restored_step, report.tasks_requeued, report.version, offset) == (0, 2, 2, 2)
    with pytest.raises(RuntimeError, match="after the failed step"):
        restart_trainer(
            failed_step=1,
            load=lambda: 3,
            journal=journal,
            requeue=queue.requeue,
            rewind=lambda s: None,
            newest_version=1,
        )
