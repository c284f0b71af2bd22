"""recover_trainer with a real LocalTrainer, checkpoint, run folder and weight store (fleet faked)."""

import copy
from types import SimpleNamespace

import torch

from moerl.config import load_config
from moerl.models import build_model
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.run.recovery import StepJournal, recover_trainer
from moerl.rundir.folder import LedgerEntry, RunDir
from moerl.trainer.batch import build_train_batch
from moerl.trainer.local import LocalTrainer
from moerl.weights.store import WeightStore

VOCAB = 16


class FakeFleet:
    def __init__(self):
        self.requeued, self.pushed = [], []

    def requeue(self, task):
        self.requeued.append(task.task_id)

    def publish(self, trainer, *, is_stored=False, is_final=False):
        assert is_stored  # recovery wrote the version itself
        self.pushed.append(trainer.version)


def _groups(step):
    out = []
    for g in range(2):
        task = RolloutTask(
            task_id=f"s{step}g{g}", prompt_ids=[3, 4], prompt_text="p", answer="a", num_samples=2
        )
        samples = [
            Sample(
                prompt_ids=[3, 4],
                response_ids=[5 + i, 6],
                response_logprobs=[-1.0, -1.2],
                loss_mask=[1, 1],
                finish_reason="stop",
                policy_versions=[0, 0],
                reward=float(i),
            )
            for i in range(2)
        ]
        out.append(Group.from_lease(Lease(task, "w", step * 10 + g, 0.0), samples, 0.1))
    return out


def test_recover_trainer_restores_checkpoint_requeues_lost_steps_and_publishes_next_version(tmp_path):
    cfg = load_config(None, ["trainer.lr=1e-2"])
    torch.manual_seed(0)
    model = build_model(
        load_config(
            None,
            [
                "model.hidden_size=16",
                "model.num_layers=1",
                "model.num_heads=2",
                "model.num_kv_heads=1",
                "model.head_dim=8",
                "model.num_experts=4",
                "model.moe_intermediate_size=8",
            ],
        ).model,
        VOCAB,
    )
    comp = SimpleNamespace(model=model, init_path=None, tokenizer=SimpleNamespace(vocab_size=VOCAB))
    run, store, fleet, journal = (
        RunDir(tmp_path / "run"),
        WeightStore(str(tmp_path / "weights")),
        FakeFleet(),
        StepJournal(),
    )
    trainer = LocalTrainer(model, cfg.trainer, cfg.algorithm)
    trainer.publish(store)  # version 0
    for step in (1, 2, 3, 4):
        groups = _groups(step)
        stats = trainer.train_step(build_train_batch(groups, pad_id=0))
        run.append_ledger([LedgerEntry(g.task_id, stats.step, 0, g.lease_token) for g in groups])
        journal.record(stats.step, [g.task for g in groups])
        if step < 4:  # killed after step 4, before publishing it
            trainer.publish(store)
        if step == 2:
            trainer.checkpoint(run.path, {})
            journal.commit(2)
            at_two = copy.deepcopy(model.state_dict())
            adam_two = copy.deepcopy(trainer.optimizer.state_dict()["state"])
    new, report = recover_trainer(cfg, comp, run, store, fleet, journal, failed_step=4)
    assert (report.failed_step, report.restored_step, report.tasks_requeued, report.version) == (4, 2, 4, 4)
    assert fleet.requeued == ["s3g0", "s3g1", "s4g0", "s4g1"] and fleet.pushed == [4]
    assert [e.step for e in run.read_ledger()] == [1, 1, 2, 2]
    assert (new.step, new.version, store.latest().version) == (2, 4, 4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, at_two[name]), name
    restored = new.optimizer.state_dict()["state"]
    assert all(torch.equal(restored[k]["exp_avg"], adam_two[k]["exp_avg"]) for k in adam_two)
    new.train_step(build_train_batch(_groups(3), pad_id=0))
    assert (new.step, new.version) == (3, 5)
    new.publish(store)  # versions keep increasing in the store
    assert store.latest().version == 5 and new.state_dict()["trainer"]["version_offset"] == 2
