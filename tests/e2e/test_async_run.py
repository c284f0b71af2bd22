"""Async mode on a local Ray instance: workers generate while the trainer trains; exactly-once accounting."""

from pathlib import Path

import pytest
from conftest import short_config

from moerl.runtime.checkpoint import load_checkpoint
from moerl.runtime.run_dir import RunDir, read_jsonl
from moerl.train import train

ray = pytest.importorskip("ray")


@pytest.fixture
def ray_session():
    yield
    ray.shutdown()


@pytest.mark.timeout(300)
def test_async_run_trains_every_task_exactly_once(tmp_path, tiny_init, ray_session):
    cfg = short_config(
        tmp_path,
        tiny_init,
        "runtime.mode=async",
        "rollout.num_workers=2",
        "trainer.steps=4",
        "trainer.batch_groups=2",
        "runtime.buffer_groups=4",
        "runtime.max_staleness=1",
        "trainer.checkpoint_every=2",
        "eval.every=2",
    )
    summary = train(cfg, live=False)
    run = RunDir(next(Path(tmp_path).glob("run-*")))
    records = read_jsonl(run.metrics)
    ids = [e.task_id for e in run.read_ledger()]
    assert summary["status"] == "completed" and summary["mode"] == "async" and len(records) == 4
    assert len(ids) == len(set(ids)) == 8 == summary["tasks_trained"]
    assert summary["tasks_lost"] == 0 and summary["tasks_duplicated"] == 0
    # every drawn task is trained, still waiting, filtered or dropped: the books balance
    assert summary["tasks_drawn"] == (
        summary["tasks_trained"]
        + summary["tasks_waiting"]
        + summary["tasks_filtered"]
        + summary["tasks_dropped_stale"]
    )
    assert summary["tasks_acked"] >= summary["tasks_trained"]
    assert all(r["buffer/staleness_max"] <= 1 for r in records)
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]
    assert all(e.policy_version >= e.step - 1 - 1 for e in run.read_ledger())  # admitted within max_staleness
    parts = load_checkpoint(run.checkpoints / "step_4")  # taken with the workers paused
    queued = {t["task_id"] for t in parts["queue"]["tasks"]}
    buffered = {g["task"]["task_id"] for g in parts["buffer"]["groups"]}
    assert not (queued & buffered) and not (queued & set(ids)) and not (buffered & set(ids))
