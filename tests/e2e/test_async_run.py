"""Async mode on a local Ray instance: workers generate while the trainer trains; exactly-once accounting."""

from pathlib import Path

import pytest
from conftest import short_config

from moerl.models import from_pretrained
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.train import train
from moerl.trainer.checkpoint import load_checkpoint
from moerl.weights.store import WeightStore

ASYNC_4_STEPS = (
    "runtime.mode=async",
    "rollout.num_workers=2",
    "trainer.steps=4",
    "trainer.batch_groups=2",
    "runtime.buffer_groups=4",
    "runtime.max_staleness=1",
)
"""The async run of every test here: 2 rollout workers, 4 steps of 2 groups, a buffer of 4, staleness 1."""
BUCKETED_DURABLE_EVERY_2 = (
    "runtime.publish_bucket_mb=0.05",
    "runtime.durable_every=2",
    "runtime.keep_versions=5",
    "fleet.check_every_s=0.2",  # fresh liveness answers carry the workers' versions and sync times
)
"""Weights sent in small buckets, the store written every 2nd version (versions 0, 2, 4 kept)."""
OBJECT_STORE_BUCKETED = (
    "runtime.weight_sync=object_store",
    *BUCKETED_DURABLE_EVERY_2,
    "rollout.on_weight_update=recompute",
    "trainer.checkpoint_every=4",
    "eval.every=2",
)
"""The one object-store run two tests read (``object_store_run``): in small buckets, the store every 2nd
version, recompute on update, an eval every 2 steps and a checkpoint at step 4. A checkpoint makes its
version durable: at step 4 only (the final version, durable anyway), so the store's versions still show
``durable_every`` alone (a checkpoint every 2 steps would write versions 2 and 4 without it)."""


def _run(tmp_path, init, *overrides: str) -> tuple[dict, RunDir, list[dict]]:
    """Train ``short_config`` with ``ASYNC_4_STEPS`` (``overrides`` win): summary, run folder, metrics records.
    The run joins the module's Ray instance (``local_ray``) instead of starting its own, as every async run
    does on a running cluster; it ends its own actors."""
    summary = train(short_config(tmp_path, init, *ASYNC_4_STEPS, *overrides), live=False)
    run = RunDir(next(Path(tmp_path).glob("run-*")))
    return summary, run, read_jsonl(run.metrics)


@pytest.fixture(scope="module")
def object_store_run(tmp_path_factory, tiny_init, local_ray) -> tuple[dict, RunDir, list[dict]]:
    """One async run with ``OBJECT_STORE_BUCKETED``, read by the object-store case of the exactly-once test
    and by the bucketed-sync test (one run of the module's Ray instance instead of two)."""
    return _run(tmp_path_factory.mktemp("object_store"), tiny_init, *OBJECT_STORE_BUCKETED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weight_sync", ["object_store", "store"])
def test_async_run_trains_every_task_exactly_once(tmp_path, tiny_init, local_ray, weight_sync, request):
    # object_store: the shared run (object_store_run), with buckets and a checkpoint at step 4 (the one
    # read below); store: a checkpoint every 2 steps, so one is taken mid-run too
    if weight_sync == "object_store":
        summary, run, records = request.getfixturevalue("object_store_run")
    else:
        summary, run, records = _run(
            tmp_path,
            tiny_init,
            f"runtime.weight_sync={weight_sync}",
            "trainer.checkpoint_every=2",
            "eval.every=2",
        )
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
    # the workers' paged KV caches, read from the actors each step: both engines' blocks, tokens prefilled
    assert all(r["rollout/kv_blocks_total"] > 0 for r in records)
    assert (
        records[-1]["rollout/kv_prefill_tokens"] > 0 and records[-1]["rollout/kv_decoding_together_mean"] > 0
    )
    assert all(e.policy_version >= e.step - 1 - 1 for e in run.read_ledger())  # admitted within max_staleness
    parts = load_checkpoint(run.checkpoints / "step_4")  # taken with the workers paused
    queued = {t["task_id"] for t in parts["queue"]["tasks"]}
    buffered = {g["task"]["task_id"] for g in parts["buffer"]["groups"]}
    assert not (queued & buffered) and not (queued & set(ids)) and not (buffered & set(ids))


@pytest.mark.timeout(300)
def test_async_bucketed_sync_durable_every_and_recompute(object_store_run):
    """runtime.weight_sync=object_store in small buckets, the store every 2nd version, recompute on update:
    every task once, the sync metrics recorded, the store holding exactly the durable versions."""
    summary, run, records = object_store_run
    assert summary["status"] == "completed" and summary["tasks_trained"] == 8
    assert summary["tasks_lost"] == 0 and summary["tasks_duplicated"] == 0
    assert all(r["timing/weight_sync_s"] > 0 for r in records)
    assert all(r["weights/sync_bytes"] > 0 for r in records)
    lags = [r["weights/version_lag_max"] for r in records if r["weights/version_lag_max"] is not None]
    assert all(lag >= 0 for lag in lags)  # from the workers' liveness answers (None before the first)
    assert WeightStore(str(run.path / "weights")).versions() == [0, 2, 4]
    assert [r["timing/final_save_s"] > 0 for r in records] == [False] * 3 + [True]  # the last step's save


@pytest.mark.timeout(300)
def test_async_cuda_ipc_sync_through_shared_buffers(tmp_path, tiny_init, local_ray):
    """runtime.weight_sync=cuda_ipc on CPU (the ring in shared memory): 2 workers connect to the trainer's
    listener and get every version through it in small buckets; every task once; the store written
    every 2nd version in the background."""
    summary, run, records = _run(
        tmp_path,
        tiny_init,
        "runtime.weight_sync=cuda_ipc",
        *BUCKETED_DURABLE_EVERY_2,
        "trainer.checkpoint_every=0",
        "eval.every=0",
    )
    print(
        [
            (r["weights/sync_bytes"], r["timing/weight_sync_worker_s"], r["weights/version_lag_max"])
            for r in records
        ]
    )
    assert summary["status"] == "completed" and summary["tasks_trained"] == 8
    assert summary["tasks_lost"] == 0 and summary["tasks_duplicated"] == 0
    model_bytes = sum(t.numel() * t.element_size() for t in from_pretrained(tiny_init).state_dict().values())
    # the workers that had connected by then (a slow machine may start the 2nd late) got it through the ring
    assert records[-1]["weights/sync_bytes"] >= model_bytes
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]
    assert WeightStore(str(run.path / "weights")).versions() == [0, 2, 4]
