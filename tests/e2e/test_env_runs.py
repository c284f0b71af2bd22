"""Multi-turn environment runs end to end: a sync run with a flaky environment, and an async run in
which an environment worker process is SIGKILLed mid-run; both keep the exactly-once accounting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import short_config

from moerl.rundir.folder import read_jsonl
from moerl.train import train

pytestmark = pytest.mark.ray_group(
    "ray_a"
)  # one Ray instance with test_async_eval_on_worker, test_verl_example

E2E_DIR = Path(__file__).parent
ENV_RUN = [
    "task.name=env",
    "task.num_eval=8",
    "env.max_turns=3",
    "env.max_tokens=24",
    "env.num_workers=2",
    "rollout.max_new_tokens=4",
    "rollout.kv_token_budget=1024",
]


def _check_accounting(summary: dict) -> None:
    assert summary["status"] == "completed"
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0


def test_sync_run_with_a_flaky_environment_requeues_failed_groups(tmp_path, tiny_init, monkeypatch):
    monkeypatch.syspath_prepend(str(E2E_DIR))
    cfg = short_config(tmp_path, tiny_init, *ENV_RUN, "env.name=e2e_envs:FlakyEnv", "trainer.steps=3")
    summary = train(cfg, live=False)
    _check_accounting(summary)
    env = summary["env"]
    assert env["raised"] >= 1 and env["errors"] == env["raised"] and summary["tasks_requeued"] >= 1
    assert env["turns_per_episode"] == 2.0 and env["latency_p50_s"] is not None
    (metrics,) = Path(tmp_path).glob("*/metrics.jsonl")
    rec = read_jsonl(metrics)[-1]
    assert (
        rec["env/turns_mean"] == 2.0
        and rec["env/errors"] >= 1
        and rec["env/latency_p99_s"] >= rec["env/latency_p50_s"]
    )


def _env_worker_pids() -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [
        int(line.split()[0])
        for line in out.splitlines()
        if "EnvWorkerActorImpl" in line and "ps -eo" not in line
    ]


@pytest.mark.timeout(300)
def test_async_run_survives_an_environment_worker_killed_by_pid(tmp_path, tiny_init, shared_ray):
    # shared_ray: its workers find e2e_envs through PYTHONPATH (this folder)
    cfg = short_config(
        tmp_path,
        tiny_init,
        *ENV_RUN,
        "env.name=e2e_envs:SlowEchoEnv",
        "runtime.mode=async",
        "trainer.steps=8",
        "rollout.num_workers=1",
        "runtime.max_staleness=2",
    )
    killed: list[int] = []

    def kill_one() -> None:  # SIGKILL one environment worker once episodes are flowing
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            pids = _env_worker_pids()
            if len(pids) >= 2 and list(Path(tmp_path).glob("*/metrics.jsonl")):
                time.sleep(1.0)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    summary = train(cfg, live=False)
    killer.join(timeout=1)
    print(
        json.dumps({k: summary[k] for k in ("tasks_requeued", "tasks_duplicated", "tasks_lost")}),
        summary["env"],
    )
    assert killed, "no environment worker was found to kill"
    _check_accounting(summary)
    env = summary["env"]
    assert env["died"] >= 1 and env["workers_lost"] >= 1 and env["errors"] >= 1
    assert summary["tasks_requeued"] >= 1 and summary["fleet"]["killed"] == 0  # the rollout worker lived on
