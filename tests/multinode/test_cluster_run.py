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
import time

import pytest
from _runs import assert_trained_exactly_once, save_fresh_policy
from mnruns import Driver
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
    run = Driver(ray, 0, tmp_path / "runs", tmp_path / "driver.log", [*OVERRIDES, f"init_from={init}"])
    run.wait_steps(2, timeout_s=240)  # training, with every rollout node delivering
    assert c.kill_node(2) > 0  # a whole rollout node lost
    c.cut(1)  # and another partitioned, processes alive
    cut_at = time.monotonic()
    while time.monotonic() - cut_at < PARTITION_S and run.proc.poll() is None:
        time.sleep(0.5)
    steps_during = run.steps_done()
    c.restore(1)
    assert run.finish(timeout_s=300) == 0, run.tail()
    text = run.tail(1_000_000)
    assert "Traceback" not in text, text[-3000:]
    assert "lost (node groups: rollout" in text  # the node's loss, an event of the run (NodeWatch)

    folder = RunDir(run.run_folder())
    summary = json.loads((folder.path / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_trained_exactly_once(summary, folder, STEPS, BATCH)
    assert steps_during < STEPS  # the faults hit a run in progress
    fleet = summary["fleet"]
    assert fleet["exchange_node"] == c.node(0).addr  # the run's state on its node group's node
    assert fleet["killed"] >= 2 and fleet["replaced"] >= 1  # both lost nodes' workers, a replacement
    assert fleet["tasks_expired"] + fleet["tasks_released"] >= 1  # the lost workers' leases went back
    lost = [r["fleet/nodes_lost"] for r in read_jsonl(folder.metrics)]
    assert lost[-1] >= 1 and lost == sorted(lost)  # in the metrics too, cumulative
    print(
        "multinode faults:",
        {k: fleet[k] for k in ("killed", "replaced", "tasks_expired", "tasks_released")},
        "requeued",
        summary["tasks_requeued"],
        "steps before restore",
        steps_during,
        "nodes lost",
        lost[-1],
    )
