"""A trainer rank SIGKILLed by pid in the middle of an async run: the group restarts from the newest
checkpoint while the rollout worker keeps generating, the run completes, every task is trained once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # noqa: F401 - the test extra installs it: missing fails, not skips
from _runs import DEFAULT_CONFIG, SHARDED_ASYNC

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _wait_for(predicate, timeout_s: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"moerl train exited ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _metric_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(500)
def test_killed_rank_restarts_the_group_and_the_run_completes(tmp_path, default_init):
    overrides = [
        f"output_dir={tmp_path}",
        f"init_from={default_init}",
        "name=kill",
        *SHARDED_ASYNC,
        "trainer.steps=10",
        "trainer.checkpoint_every=4",
        "task.num_eval=16",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", "import sys; from moerl.cli import main; sys.exit(main(sys.argv[1:]))"]
    args = ["train", "--config", str(DEFAULT_CONFIG)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(
        [*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        run = _wait_for(lambda: next(iter(tmp_path.glob("kill-*")), None), 120, proc, "the run folder")
        _wait_for(lambda: _metric_steps(run) >= 6, 300, proc, "step 6 (after the step-4 checkpoint)")
        before = json.loads((run / "trainer_ranks.json").read_text())["pids"]
        os.kill(before[1], signal.SIGKILL)  # a real death of trainer rank 1
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    after = json.loads((run / "trainer_ranks.json").read_text())["pids"]
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert summary["fleet"]["trainer_restarts"] == 1 and not set(after) & set(before)
    assert "trainer group restarted from step 4" in out or "trainer group restarted from step 8" in out
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
    assert summary["tasks_trained"] == 10 * 4
