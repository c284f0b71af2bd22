"""A training group whose rank died (or hung past the collective timeout) is replaced by a new one.

    tear the group down (every rank; the dead one is gone already)
    -> start R new ranks, load the newest checkpoint (sharded DCP; any saved world size)
    -> hand back to the queue the tasks of the steps since that checkpoint (``StepJournal``) and of the
       batch that was being trained, cut the ledger and metrics back, publish the restored weights as
       a new version (versions never go backwards)

The rollout workers keep generating meanwhile: they meet the trainer only through the buffer, the
queue and the weight store. Every task drawn is trained exactly once (``moerl.run.recovery``).
"""

from __future__ import annotations

from collections.abc import Sequence

from moerl.records import Group
from moerl.run.recovery import RestartReport, StepJournal, restart_and_publish
from moerl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from moerl.trainer.distributed.factory import load_trainer_state, make_trainer, record_ranks
from moerl.trainer.distributed.group import TrainerGroup


def restart_group(
    cfg,
    comp,
    run,
    store,
    fleet,
    journal: StepJournal,
    dead: TrainerGroup,
    lost: Sequence[Group] = (),
    newest_pushed: int = 0,
) -> tuple[TrainerGroup, RestartReport]:
    """Replace the group ``dead`` (see the module docstring); returns the new group and the report.

    Args:
        cfg, comp, run, store, fleet, journal: as for ``moerl.run.recovery.recover_trainer``.
        dead: the failed group; its last completed step is the failed step.
        lost: groups taken from the buffer for a step that did not complete (requeued).
        newest_pushed: newest version streamed to the workers (with ``runtime.durable_every > 1`` the
            store may be older); the restored weights get a newer one.
    """
    failed_step = dead.step
    dead.close()
    for group in lost:
        fleet.requeue(group.task)
    trainer = make_trainer(cfg, comp.model, comp.init_path, run.path)

    def load() -> int:
        ckpt = latest_checkpoint(run.path)
        if ckpt is None:  # no checkpoint yet: the new ranks start again from the warm-start weights
            return 0
        load_trainer_state(trainer, ckpt, load_checkpoint(ckpt, contents=False))  # checked when picked
        return trainer.step

    report = restart_and_publish(trainer, load, run, store, fleet, journal, failed_step, newest_pushed)
    record_ranks(trainer, run.path)
    return trainer, report
