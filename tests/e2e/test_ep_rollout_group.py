"""EP rollout worker groups in async runs (rollout.ep_size=2), configs/default.yaml shortened.

- One follower rank process SIGKILLed by pid mid-run: the group's worker ends as crashed, a new group
  replaces it; then that group's leader SIGKILLed: its follower ends with it, a third group replaces
  it; nothing is lost or trained twice, and no rank process of a lost group is left. This run's trainer
  is the one-process trainer: what it asserts is the rollout side's, and a trainer group would add two
  Ray rank processes (each importing torch and building the sharded policy: 40-70 s of the loaded 2
  cores) that no assertion reads.

A run of a 2-rank rollout group beside a 2-rank trainer group (the run completes; every task trained
exactly once; the worker reports its 2 EP ranks; the evals are the EP group's) is
``test_run_with_a_two_rank_rollout_group`` in tests/e2e/test_collective_run.py: it reads that module's
one run of both groups (weights by broadcast) instead of starting 4 more rank processes here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from _runs import DEFAULT_CONFIG, assert_trained_exactly_once, newest_run, run_config

from moerl.models import build_model
from moerl.tasks import load_tokenizer
from moerl.train import train

pytestmark = [
    pytest.mark.usefixtures("no_report_figures"),  # no test here reads report.png
    pytest.mark.ray_group("ray_b"),  # one Ray instance with test_reward_model_runs
]

BATCH = 4


def _config(out: Path, init: Path, steps: int, *overrides: str):
    return run_config(
        DEFAULT_CONFIG,
        out,
        init,
        "runtime.mode=async",
        "rollout.num_workers=1",
        "rollout.ep_size=2",
        "trainer.num_ranks=2",
        f"trainer.steps={steps}",
        f"trainer.batch_groups={BATCH}",
        "trainer.micro_batch_size=32",
        "trainer.checkpoint_every=0",
        "rollout.max_new_tokens=4",
        "rollout.max_slots=8",
        "rollout.kv_token_budget=512",
        "runtime.buffer_groups=8",
        "runtime.lease_ttl_s=10",
        "eval.every=0",
        "task.num_eval=16",
        "task.reward_fn=e2e_rewards:first_is_digit",
        "fleet.check_every_s=0.2",
        *overrides,
    )


def _records(out: Path) -> int:
    metrics = list(out.glob("default-*/metrics.jsonl"))
    return len(metrics[0].read_text().splitlines()) if metrics else 0


def _group_names(worker_id: str) -> list[str]:
    """Named follower actors of ``worker_id``'s group: ``<worker_id>-ep<r>-<leader pid>``."""
    return [n for n in ray.util.list_named_actors() if n.startswith(f"{worker_id}-ep1-")]


def _wait(condition, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_ranks_mid_run(out: Path, killed: dict, seen: list[dict]) -> None:
    """Once 2 steps are trained: note the first group's rank 1 (engine state), SIGKILL it by its pid;
    once the replacement group has delivered for a step: SIGKILL its leader (rank 0) by its pid."""
    # under a loaded CI machine the group's start and the first two steps can take minutes
    if not _wait(lambda: _records(out) >= 2 and _group_names("rollout-0"), 240):
        return
    follower = ray.get_actor(_group_names("rollout-0")[0])
    seen.append(ray.get(follower.ep_state.remote()))
    killed["follower"] = ray.get(follower.pid.remote())
    os.kill(killed["follower"], signal.SIGKILL)
    if not _wait(lambda: bool(_group_names("rollout-1"))):
        return
    up_at = _records(out)
    if _wait(lambda: _records(out) > up_at):
        name = _group_names("rollout-1")[0]
        killed["second_follower"] = ray.get(ray.get_actor(name).pid.remote())  # must go with its leader
        killed["leader"] = int(name.rsplit("-", 1)[1])
        os.kill(killed["leader"], signal.SIGKILL)


def _expert_bytes(cfg) -> int:
    model = build_model(cfg.model, load_tokenizer(None).vocab_size)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@pytest.mark.timeout(420)
def test_killed_rank_loses_the_worker_not_a_task(shared_ray, default_init, tmp_path):
    steps = 14
    killed: dict[str, int] = {}
    seen: list[dict] = []
    killer = threading.Thread(target=_kill_ranks_mid_run, args=(tmp_path, killed, seen), daemon=True)
    killer.start()
    cfg = _config(tmp_path, default_init, steps, "trainer.num_ranks=1")  # module docstring: why one
    summary = train(cfg, live=False)
    killer.join(5)
    assert killed.keys() == {"follower", "second_follower", "leader"}, f"not both ranks were killed: {killed}"
    # before the kill, the follower ran newer weights than version 0 and held half of the experts
    assert seen[0]["version"] >= 1 and seen[0]["expert_bytes"] * 2 == _expert_bytes(cfg), seen
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert_trained_exactly_once(summary, newest_run(cfg), steps, BATCH)
    fleet = summary["fleet"]
    assert fleet["killed"] == 2 and fleet["spawned"] == 3, fleet
    # ``replaced`` counts a replacement once the fleet has polled its first health report; the third
    # group can deliver the run's last groups before that poll (seen under load), so it may count 1
    assert fleet["replaced"] in (1, 2), fleet
    pids = fleet["worker_rank_pids"]
    assert killed["follower"] == pids["rollout-0"][1]  # EP rank 1 of the first group
    second = [killed["leader"], killed["second_follower"]]  # EP ranks 0 and 1 of the second group
    # the fleet knows the second group's pids once it has polled its first liveness answer; under load
    # the kill can come first (as with ``replaced``), then the killer's own reading stands alone
    assert pids.get("rollout-1", second) == second, (pids, killed)
    for pid in {*pids["rollout-0"], *second}:  # both lost groups are gone, every rank
        assert _wait(lambda pid=pid: not _alive(pid), 10), f"rank process {pid} outlived its group"
    assert len(set(pids["rollout-2"])) == 2  # the third group finished the run ...
    assert not [n for n in ray.util.list_named_actors() if n.startswith("rollout-")]  # ... and ended with it


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed Ray worker until the raylet reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
