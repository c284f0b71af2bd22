"""Reads from S3 under faults: a resume's fetch of a stored run (``fetch_run``: lookups, downloads, the
checkpoint listing) and a rollout worker's ``WeightStore`` reads (listing, manifest, data files), against
moto's S3 server behind ``s3_faults``' proxy failing reads and listings with 500s, 503 ``SlowDown``
(throttling) and dropped connections. Transient faults are retried through; faults that persist end in
one line naming the operation. The S3 client's own retries are off (``max_attempts`` 1), so moerl's retries
(``moerl.retry``) are what carries the reads through (s3fs still retries ``SlowDown`` itself).
"""

import json
import os

import boto3
import pytest
import torch
from s3_faults import Fault, S3WithFaults

from moerl.cli import main as cli_main
from moerl.errors import StorageError
from moerl.rundir.storage import RunStorage, fetch_run
from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint
from moerl.weights.store import WeightStore

BUCKET = "moerl-reads"
pytestmark = pytest.mark.timeout(180)

TRANSIENT = {  # name -> the fault plan: each fault fails the next 2 matching requests
    "500": [Fault("list", "500", times=2), Fault("read", "500", times=2)],
    "slowdown": [Fault("list", "503", times=2), Fault("read", "503", times=2)],
    "cut": [Fault("list", "cut", times=2), Fault("read", "cut", times=2)],
}
"""A resume's listing faults hit the checkpoint listing (``match="checkpoints"``)."""


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


@pytest.fixture(autouse=True)
def _no_faults_after(s3):
    yield
    s3.plan = []


def _options(s3) -> dict:
    return {"endpoint_url": s3.endpoint_url, "config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.fixture(scope="module")
def stored_run(s3, tmp_path_factory):
    """A run in S3 as a training run leaves it: run files and two committed checkpoints (steps 2, 4)."""
    local = tmp_path_factory.mktemp("stored")
    storage = RunStorage(f"s3://{BUCKET}/runs/run-1", options=_options(s3))
    for name, text in {
        "config.yaml": "trainer: {steps: 4}\n",
        "metrics.jsonl": "{}\n",
        "ledger.jsonl": "",
    }.items():
        (local / name).write_text(text)
        storage.put_file(local / name, name)
    for step in (2, 4):
        path = save_checkpoint(local, step, {"trainer": {"step": step}})
        storage.put_tree(path, f"checkpoints/step_{step}")
    return storage.url


@pytest.fixture(scope="module")
def weights(s3):
    """A weight store in S3 with versions 1 and 2 of two tensors; returns (url, version 2's tensors)."""
    url = f"s3://{BUCKET}/weights"
    store = WeightStore(url, storage_options=_options(s3))
    for version in (1, 2):
        tensors = {"a.weight": torch.full((4, 3), float(version)), "b.bias": torch.arange(5.0) * version}
        store.publish(version, tensors)
    return url, tensors


def _all_served(plan: list[Fault]) -> bool:
    return all(f.times == 0 for f in plan)


@pytest.mark.parametrize("faults", list(TRANSIENT))
def test_resume_fetch_survives_transient_read_and_list_faults(s3, stored_run, tmp_path, faults):
    s3.plan = [
        Fault(f.method, f.kind, f.times, "checkpoints" if f.method == "list" else None)
        for f in TRANSIENT[faults]
    ]
    local = fetch_run(stored_run, tmp_path, options=_options(s3))
    assert _all_served(s3.plan), s3.plan  # every planned fault was served, and retried through
    assert (local / "config.yaml").read_text() == "trainer: {steps: 4}\n"
    assert [p.name for p in (local / "checkpoints").iterdir()] == [
        "step_4"
    ]  # the newest, listed under faults
    assert load_checkpoint(local / "checkpoints" / "step_4")["trainer"] == {"step": 4}


@pytest.mark.parametrize("faults", list(TRANSIENT))
def test_weight_store_read_survives_transient_read_and_list_faults(s3, weights, faults):
    url, want = weights
    reader = WeightStore(
        url, storage_options=_options(s3)
    )  # a worker's reader (its probe write is an upload)
    s3.plan = [Fault(f.method, f.kind, f.times, f.match) for f in TRANSIENT[faults]]
    version, got = reader.load_latest()
    assert _all_served(s3.plan), s3.plan
    assert version.version == 2 and got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_resume_whose_listing_keeps_failing_stops_with_one_line(s3, stored_run, tmp_path, capsys):
    s3.plan = [Fault("list", "503", match="checkpoints")]  # throttled for good
    argv = ["train", "--resume", stored_run, "--set", f"output_dir={tmp_path}"]
    assert cli_main([*argv, "--set", f"storage.options={json.dumps(_options(s3))}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"moerl: storage: listing of {stored_run}/checkpoints failed after 3 attempts: "
    )
    assert "reduce your request rate" in err[-1] and not any("Traceback" in line for line in err)
    assert list(tmp_path.iterdir()) == []  # nothing fetched is left behind


@pytest.mark.parametrize("method", ["list", "read"])
def test_a_weight_read_that_keeps_failing_raises_one_line(s3, weights, method):
    url, _ = weights
    reader = WeightStore(url, storage_options=_options(s3))
    reader.read_backoff_s = 0.1
    s3.plan = [Fault(method, "500")]
    with pytest.raises(StorageError) as info:
        reader.load_latest()
    message = str(info.value)
    what = f"listing of {url} " if method == "list" else f"read of {url}/v00000002/manifest.json "
    assert message.startswith(f"storage: {what}") and "failed after 3 attempts" in message, message
    assert "\n" not in message
