"""Run storage in S3 end to end, against moto's S3 server on 127.0.0.1 with uploads failing on purpose.

A short ``moerl train`` with ``storage.url=s3://...`` writes its checkpoints, weight versions, metrics,
policy and summary there; ``--resume s3://...`` continues it exactly like an uninterrupted run. While
uploads fail (500s and connections cut mid-body), a reader polls the bucket: every checkpoint it is
offered as complete loads, every weight version it is offered verifies, and the run retries through.
An upload that keeps failing stops the run with one line and leaves no partial checkpoint visible.
"""

import json
import os
import threading
import time
from pathlib import Path

import boto3
import moto.server  # noqa: F401 - the test extra installs it: missing fails, not skips
import pytest
import s3fs  # noqa: F401 - the test extra installs it: missing fails, not skips
import torch
from conftest import short_config
from s3_faults import S3WithFaults

from moerl.cli import main as cli_main
from moerl.config import RunConfig, save_config
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.rundir.storage import MARKER, RunMirror, RunStorage, StorageError, fetch_run
from moerl.telemetry.metrics import without_wall_clock
from moerl.train import train
from moerl.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from moerl.weights.store import StoreNotWritableError, WeightStore

BUCKET = "moerl-runs"
# no test here reads report.png: the runs skip drawing it (conftest.no_report_figures)
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_report_figures")]


@pytest.fixture(scope="module")
def s3():
    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    with S3WithFaults(seed=0) as server:
        boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
        yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _storage(s3, prefix):
    return [
        f"storage.url=s3://{BUCKET}/{prefix}",
        f"storage.options={json.dumps({'endpoint_url': s3.endpoint_url})}",
    ]


class Reader(threading.Thread):
    """Polls the runs under a prefix as another machine would: loads every checkpoint and weight version
    that storage offers as complete, and records anything that does not load."""

    def __init__(self, s3, prefix, scratch: Path):
        super().__init__(daemon=True)
        self.options = {"endpoint_url": s3.endpoint_url}
        self.root = RunStorage(f"s3://{BUCKET}/{prefix}", options=self.options)
        self.scratch, self.stop, self.errors = scratch, threading.Event(), []
        self.checkpoints, self.versions = set(), set()
        self.stores: dict[str, WeightStore] = {}  # one a run: its probe write once, not at every poll

    def run(self):
        while not self.stop.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
            self.stop.wait(0.2)

    def poll(self):
        try:
            runs = [p.rsplit("/", 1)[-1] for p in self.root.fs.ls(self.root.root, detail=False, refresh=True)]
        except FileNotFoundError:
            return
        for name in runs:
            for step, rel in self.root.complete_checkpoints(name):
                if (name, step) in self.checkpoints:
                    continue
                local = self.scratch / f"{name}-{step}-{time.monotonic_ns()}"
                try:
                    self.root.get_tree(rel, local)
                except FileNotFoundError:  # pruned (marker removed) between listing and reading
                    continue
                assert load_checkpoint(local)["trainer"] is not None
                self.checkpoints.add((name, step))
            if name not in self.stores:
                try:
                    self.stores[name] = WeightStore(
                        f"{self.root.url}/{name}/weights", storage_options=self.options
                    )
                except StoreNotWritableError:
                    continue  # the reader's own probe write hit an injected fault
            latest = self.stores[name].latest()  # a fresh listing (WeightStore invalidates s3fs's cache)
            if latest is not None and (name, latest.version) not in self.versions:
                try:
                    self.stores[name].load(latest.version)  # checks every file's sha256
                except FileNotFoundError:  # pruned meanwhile
                    continue
                self.versions.add((name, latest.version))


def test_train_and_resume_through_s3_while_uploads_fail(tmp_path, tiny_init, s3):
    common = ["trainer.lr=1e-3", "trainer.checkpoint_every=2", "eval.every=2", "runtime.keep_checkpoints=2"]
    train(short_config(tmp_path / "full", tiny_init, "trainer.steps=6", *common), live=False)  # no storage
    full = next((tmp_path / "full").glob("run-*"))
    reader = Reader(s3, "runs", tmp_path / "reader")
    reader.start()
    s3.fail_rate, before = 0.25, dict(s3.injected)
    try:
        cfg = short_config(tmp_path / "a", tiny_init, "trainer.steps=4", *common, *_storage(s3, "runs"))
        summary = train(cfg, live=False)
        url = summary["storage_url"]
        assert summary["status"] == "completed" and url.startswith(f"s3://{BUCKET}/runs/run-")
        argv = ["train", "--resume", url, "--set", "trainer.steps=6", "--set", f"output_dir={tmp_path / 'b'}"]
        assert cli_main([*argv, *sum((["--set", o] for o in _storage(s3, "runs")[1:]), [])]) == 0
    finally:
        s3.fail_rate = 0.0
        time.sleep(0.5)
        reader.stop.set()
        reader.join(timeout=30)
    injected = sum(s3.injected.values()) - sum(before.values())
    print(
        f"injected {s3.injected}; reader loaded {len(reader.checkpoints)} checkpoints, {len(reader.versions)} versions"
    )
    assert injected >= 5, s3.injected  # the uploads did fail, and the run retried through them
    assert reader.errors == []
    assert reader.checkpoints and reader.versions  # the reader did see complete ones while the run ran
    remote = RunStorage(url, options={"endpoint_url": s3.endpoint_url})
    assert [s for s, _ in remote.complete_checkpoints()] == [4, 6]
    assert remote.committed_files("policy") is not None
    stored = json.loads(remote.fs.cat_file(f"{remote.root}/summary.json"))
    assert stored["steps"] == 6 and stored["tasks_lost"] == stored["tasks_duplicated"] == 0
    (tmp_path / "metrics.jsonl").write_bytes(remote.fs.cat_file(f"{remote.root}/metrics.jsonl"))
    resumed = [without_wall_clock(r) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert resumed == [without_wall_clock(r) for r in read_jsonl(full / "metrics.jsonl")]  # same as one run
    versions = WeightStore(f"{url}/weights", storage_options={"endpoint_url": s3.endpoint_url}).versions()
    assert versions[-1] == 6


def test_an_upload_that_keeps_failing_stops_the_run_with_one_line(tmp_path, tiny_init, s3, capsys):
    cfg = short_config(
        tmp_path,
        tiny_init,
        "trainer.steps=4",
        "trainer.checkpoint_every=2",
        "storage.retries=2",
        *_storage(s3, "stuck"),
    )
    save_config(cfg, tmp_path / "run.yaml")
    s3.block = "checkpoints/step_2/"
    try:
        assert cli_main(["train", "--config", str(tmp_path / "run.yaml")]) == 1
    finally:
        s3.block = None
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moerl: storage: upload of ") and "checkpoints/step_2/" in err[-1]
    assert "failed after 2 attempts" in err[-1] and not any("Traceback" in line for line in err)
    (run_path,) = [p for p in tmp_path.glob("run-*")]
    assert [s for s, _ in list_checkpoints(run_path)] == [2]  # the local checkpoint is whole
    remote = RunStorage(f"s3://{BUCKET}/stuck/{run_path.name}", options={"endpoint_url": s3.endpoint_url})
    assert remote.complete_checkpoints() == [] and remote.committed_files("checkpoints/step_2") is None


def test_a_resume_skips_a_checkpoint_damaged_in_s3(tmp_path, s3, capsys):
    """A file of the newest checkpoint changed in the bucket after its commit (same size, other bytes):
    the fetch for a resume skips it with one line, as a damaged local checkpoint is, and takes the one
    before; only when every checkpoint is damaged is the resume refused."""
    run = RunDir.create(RunConfig(output_dir=str(tmp_path / "a")))
    options = {"endpoint_url": s3.endpoint_url}
    mirror = RunMirror(RunStorage(f"s3://{BUCKET}/damaged/{run.path.name}", options=options), run.path)
    for step in (2, 4):
        save_checkpoint(
            run.path, step, {"model": {"w": torch.full((4,), float(step))}, "trainer": {"step": step}}
        )
        mirror.checkpoint(step)
    url, s3_client = mirror.url, boto3.client("s3", endpoint_url=s3.endpoint_url)

    def damage(step):
        name = sorted(mirror.storage.committed_files(f"checkpoints/step_{step}"))[0]
        key = f"damaged/{run.path.name}/checkpoints/step_{step}/{name}"
        size = s3_client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=b"x" * size)  # same size: only the sha256 differs
        return name

    name = damage(4)
    capsys.readouterr()
    local = fetch_run(url, tmp_path / "b", options=options)
    assert capsys.readouterr().err == (
        f"moerl: {url}/checkpoints/step_4: {name} does not match its sha256 in {MARKER}; resuming from step_2\n"
    )
    assert [s for s, _ in list_checkpoints(local)] == [2]
    damage(2)
    with pytest.raises(
        StorageError, match=rf"^storage: no checkpoint of {url} is undamaged: {url}/checkpoints/"
    ):
        fetch_run(url, tmp_path / "c", options=options)
    assert not (tmp_path / "c").exists() or list((tmp_path / "c").iterdir()) == []
