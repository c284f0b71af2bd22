"""An async run on a local three-node Ray cluster shaped like the render's, with its storage in S3.

The nodes advertise the render's custom resources (head: ``exchange``; a ``train`` node; a ``rollout``
node of two workers). ``moerl train`` connects to the cluster; the rollout workers are placed only on
the rollout node, take their weight versions from S3 (the run shares no folder with them), and the
run's checkpoints and summary land in the bucket. The rollout resource also turns the fleet's scaling
hint into Ray autoscaler requests, within ``fleet.min_workers``/``fleet.max_workers``.
"""

import json
import os

import boto3
import pytest
import ray
import s3fs  # noqa: F401 - the test extra installs it: missing fails, not skips
from conftest import short_config
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
from ray.cluster_utils import Cluster
from ray.experimental.internal_kv import _internal_kv_get
from s3_faults import S3WithFaults

from moerl.cluster.resources import node_resources
from moerl.config import load_config
from moerl.rundir.storage import RunStorage
from moerl.train import train

# no test here reads report.png: the runs skip drawing it (conftest.no_report_figures)
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_report_figures")]
BUCKET = "moerl-cluster"


IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""


@pytest.fixture
def s3_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with S3WithFaults() as s3:
        boto3.client("s3", endpoint_url=s3.endpoint_url).create_bucket(Bucket=BUCKET)
        yield s3


def test_async_run_on_a_rendered_cluster_shape_with_s3_storage(tmp_path, tiny_init, s3_env, monkeypatch):
    recipe = load_config("configs/cluster_qwen3_30b_1node.yaml", [IMAGE, IMAGE])
    e2e = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (e2e, os.environ.get("PYTHONPATH")) if p))
    # no log monitors: no assertion reads the actors' output, and each node's monitor would scan the
    # session folder the three nodes share on this host for the run's duration
    quiet = {"include_log_monitor": False}
    cl = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": node_resources(recipe, "memory"),
            "include_dashboard": False,
            **quiet,
        },
    )
    try:
        nodes = {
            "train": cl.add_node(num_cpus=1, resources=node_resources(recipe, "train"), **quiet).node_id,
            "rollout": cl.add_node(num_cpus=2, resources=node_resources(recipe, "rollout"), **quiet).node_id,
        }
        cl.wait_for_nodes()
        options = json.dumps({"endpoint_url": s3_env.endpoint_url})
        cfg = short_config(
            tmp_path,
            tiny_init,
            "runtime.mode=async",
            f"runtime.ray_address={cl.address}",
            "rollout.num_workers=2",
            "fleet.min_workers=1",
            "fleet.max_workers=2",
            "trainer.steps=4",
            "trainer.checkpoint_every=2",
            f"storage.url=s3://{BUCKET}/runs",
            f"storage.options={options}",
        )
        summary = train(cfg, live=False)
        # the run ended the connection it made (moerl.train keeps only one that was up before it): join the
        # cluster again to read what the run left in its GCS (actors, dead ones too; the autoscaler's KV)
        ray.init(address=cl.address, configure_logging=False, log_to_driver=False)
        actors = ray._private.state.actors().values()
        workers = [a for a in actors if a["ActorClassName"] == "RolloutWorkerActor"]
        assert workers and {a["Address"]["NodeID"] for a in workers} == {nodes["rollout"]}
        (exchange,) = [a for a in actors if a["ActorClassName"] == "ExchangeActor"]
        assert exchange["Address"]["NodeID"] == cl.head_node.node_id  # the memory group's node
        # the scaling hint went to the autoscaler as rollout-worker bundles, within [1, 2] workers
        requested = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))
        assert 1 <= len(requested) <= 2 and all(b == {"CPU": 1.0, "rollout": 0.001} for b in requested)
    finally:
        ray.shutdown()
        cl.shutdown()
    assert summary["status"] == "completed" and summary["tasks_lost"] == summary["tasks_duplicated"] == 0
    assert summary["storage_url"].startswith(f"s3://{BUCKET}/runs/")
    remote = RunStorage(summary["storage_url"], options=json.loads(options))
    assert [s for s, _ in remote.complete_checkpoints()] == [2, 4]
    assert remote.exists("summary.json") and remote.exists("weights")
    # the workers built their policy from a copy of the model folder staged beside the weight versions
    assert RunStorage(f"{summary['storage_url']}/weights", options=json.loads(options)).committed_files(
        "init"
    )
    local = next(tmp_path.glob("run-*"))
    assert not (local / "weights").exists()  # the workers had no folder to share: versions went to S3
