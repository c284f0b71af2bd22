"""``moerl train --ray-address`` on a real Ray cluster of four namespaced nodes, with rollout nodes lost.

    node 0  head, driver (``moerl train``), Ray resources ``train`` + ``exchange``: the trainer, the exchange
    node 1  rollout (1 worker)   partitioned for 45 s, then restored with its processes alive
    node 2  rollout (1 worker)   killed whole (every process of the node at once)
    node 3  rollout (2 CPUs)     keeps generating; replacements land here

One run holds the cases (a fault each, at the same time, on a run already training): it completes, the
ledger is exact (every task trained once, 0 lost, 0 duplicated), and the exchange stayed on node 0 (its
node group), so losing the nodes that hold only rollout workers cost only rollout work: their leases
expired and were requeued, a late delivery of the partitioned worker was refused by its lease fence.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from _runs import DEFAULT_CONFIG, assert_trained_exactly_once, save_fresh_policy
from netns import Cluster
from raynodes import RayNodes

from moerl.run.folder import RunDir, read_jsonl

STEPS, BATCH = 24, 4
PARTITION_S = 45.0

OVERRIDES = [
    "name=multinode",
    "runtime.mode=async",
    "rollout.num_workers=3",
    f"trainer.steps={STEPS}",
    f"trainer.batch_groups={BATCH}",
    "trainer.micro_batch_size=64",
    "trainer.warmup_steps=0",
    "trainer.checkpoint_every=8",
    "rollout.group_size=4",
    "rollout.max_slots=16",
    "rollout.max_new_tokens=4",
    "runtime.max_staleness=1",
    "runtime.buffer_groups=8",
    "runtime.lease_ttl_s=10",
    "eval.every=0",
    "task.num_eval=20",
    "fleet.check_every_s=0.5",
    "fleet.heartbeat_timeout_s=15",
]


def _steps_done(out: Path) -> int:
    runs = list(out.glob("multinode-*/metrics.jsonl"))
    return len(read_jsonl(runs[0])) if runs else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from netns import skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    with Cluster(4) as c:
        nodes = {0: {"train": 1, "exchange": 1}, 1: {"rollout": 1}, 2: {"rollout": 1}, 3: {"rollout": 2}}
        ray = RayNodes(c, nodes, cpus={0: 1, 1: 1, 2: 1, 3: 2}).start()
        yield c, ray
    assert c.leftovers() == []


def test_rollout_nodes_partitioned_and_killed(cluster, tmp_path):
    c, ray = cluster
    init = save_fresh_policy(tmp_path / "policy")
    out = tmp_path / "runs"
    argv = [*ray.python, "-m", "moerl.cli", "train", "--config", str(DEFAULT_CONFIG), "--ray-address", ray.address]
    for o in [*OVERRIDES, f"output_dir={out}", f"init_from={init}"]:
        argv += ["--set", o]
    log = open(tmp_path / "driver.log", "w")
    driver = c.popen(0, argv, env=ray.env, stdout=log, stderr=subprocess.STDOUT)

    deadline = time.monotonic() + 150
    while _steps_done(out) < 2:  # training, with every rollout node delivering
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no step after 150 s: " + (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(0.5)
    assert c.kill_node(2) > 0  # a whole rollout node lost
    c.cut(1)  # and another partitioned, processes alive
    cut_at = time.monotonic()
    while time.monotonic() - cut_at < PARTITION_S and driver.poll() is None:
        time.sleep(0.5)
    steps_during = _steps_done(out)
    c.restore(1)
    try:
        rc = driver.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("run did not finish: " + (tmp_path / "driver.log").read_text()[-3000:])
    text = (tmp_path / "driver.log").read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]

    run = RunDir(next(out.glob("multinode-*")))
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_trained_exactly_once(summary, run, STEPS, BATCH)
    assert steps_during < STEPS  # the faults hit a run in progress
    fleet = summary["fleet"]
    assert fleet["killed"] >= 2 and fleet["replaced"] >= 1  # both lost nodes' workers, a replacement
    assert fleet["tasks_expired"] + fleet["tasks_released"] >= 1  # the lost workers' leases went back
    print("multinode faults:", {k: fleet[k] for k in ("killed", "replaced", "tasks_expired", "tasks_released")},
          "requeued", summary["tasks_requeued"], "steps before restore", steps_during)
