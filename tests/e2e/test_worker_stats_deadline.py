"""A step's call for the rollout workers' stats does not wait on a worker that cannot answer.

After a node is lost or partitioned, Ray declares its actors dead only after its own health checks (30-60 s);
until then a ``ray.get`` on their calls blocks. ``RayRollouts.worker_stats`` (read at every async step) waits
``fleet.heartbeat_timeout_s`` for all workers at once and leaves out those that did not answer, as it leaves
out those that died. Real actors on the shared Ray instance: one answers, one hangs, one is killed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray

from moerl.runtime.ray.rollouts import RayRollouts

pytestmark = pytest.mark.ray_group("ray_b")  # one Ray instance with test_ep_rollout_group, reward runs

HANG_S = 40.0
"""How long the hung worker takes to answer: far beyond the deadline below."""


class _Worker:
    def __init__(self, name: str, delay_s: float) -> None:
        self.name, self.delay_s = name, delay_s

    def worker_stats(self) -> str:
        time.sleep(self.delay_s)
        return self.name


def _wait_dead(actor, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError(f"the killed actor still answers after {timeout_s:.0f} s")


@pytest.mark.timeout(120)
def test_worker_stats_leaves_out_a_worker_that_does_not_answer_by_the_heartbeat_timeout(shared_ray):
    cls = ray.remote(num_cpus=0)(_Worker)
    ok, hung, dead = cls.remote("ok", 0.0), cls.remote("hung", HANG_S), cls.remote("dead", 0.0)
    ray.get([ok.__ray_ready__.remote(), hung.__ray_ready__.remote(), dead.__ray_ready__.remote()], timeout=60)
    ray.kill(dead)
    _wait_dead(dead)  # ray.kill is asynchronous: a call made right after it may still be served
    rollouts = RayRollouts.__new__(RayRollouts)  # only the two attributes worker_stats reads
    rollouts.backend = SimpleNamespace(alive_handles=lambda: [ok, hung, dead])
    rollouts.cfg = SimpleNamespace(fleet=SimpleNamespace(heartbeat_timeout_s=3.0))
    try:
        assert rollouts.worker_stats() == ["ok"]  # without the deadline: ["ok", "hung"] after HANG_S
    finally:
        ray.kill(ok)
        ray.kill(hung)
