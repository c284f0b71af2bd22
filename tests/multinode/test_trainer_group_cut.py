"""A trainer group over two namespaced nodes (``trainer.num_ranks=2``: one rank per node, gloo across the
veth pair) whose link is cut mid-run for longer than the collective timeout and then restored: rank 0's
collective times out, the run restarts the group from its newest checkpoint (the cut rank's node is back by
then, so the new group spans both nodes again), and the run completes with the ledger exact.

    node 0  head, driver, `train` + `exchange`: rank 0
    node 1  `train`: rank 1                       link cut for CUT_S, restored
    node 2  `rollout`: one rollout worker
"""

from __future__ import annotations

import json
import time

import pytest
from _runs import assert_trained_exactly_once, save_fresh_policy
from mnruns import Driver
from netns import Cluster, skip_reason
from raynodes import RayNodes

from moerl.run.folder import RunDir

STEPS, BATCH = 10, 4
CUT_S = 25.0  # > trainer.collective_timeout_s, < the health-check window (RayNodes: 12 x 3 s)

OVERRIDES = [
    "name=groupcut",
    "runtime.mode=async",
    "rollout.num_workers=1",
    "trainer.num_ranks=2",
    "trainer.collective_timeout_s=8",
    f"trainer.steps={STEPS}",
    f"trainer.batch_groups={BATCH}",
    "trainer.micro_batch_size=32",
    "trainer.warmup_steps=0",
    "trainer.checkpoint_every=2",
    "rollout.group_size=4",
    "rollout.max_slots=16",
    "rollout.max_new_tokens=4",
    "runtime.buffer_groups=8",
    "runtime.lease_ttl_s=10",
    "eval.every=0",
    "task.num_eval=20",
    "fleet.check_every_s=0.5",
]


def test_trainer_group_link_cut(tmp_path):
    if reason := skip_reason():
        pytest.skip(reason)
    with Cluster(3) as c:
        nodes = {0: {"train": 1, "exchange": 1}, 1: {"train": 1}, 2: {"rollout": 1}}
        ray = RayNodes(c, nodes).start()  # 1 CPU a node: the two rank bundles (1 CPU each) split over 0 and 1
        init = save_fresh_policy(tmp_path / "policy")
        run = Driver(ray, 0, tmp_path / "runs", tmp_path / "driver.log", [*OVERRIDES, f"init_from={init}"])
        run.wait_steps(3, timeout_s=240)
        c.cut(1)
        time.sleep(CUT_S)
        c.restore(1)
        assert run.finish(timeout_s=300) == 0, run.tail()
        text = run.tail(100_000)
    assert "trainer group failed" in text and "trainer group restarted from step" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    folder = RunDir(run.run_folder())
    summary = json.loads((folder.path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["fleet"]["trainer_restarts"] >= 1
    assert_trained_exactly_once(summary, folder, STEPS, BATCH)
    assert c.leftovers() == []
