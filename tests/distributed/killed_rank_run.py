"""One async ``moerl train`` run (a CLI subprocess, its own local Ray) of ``configs/default.yaml`` shortened
by ``_runs.SHARDED_ASYNC``: 2 trainer ranks as Ray actors (gloo, EP 2) next to one rollout worker, 12 steps,
a checkpoint every 4, 32 held-out tasks. Once step 6 is logged (after the step-4 checkpoint), trainer rank 1
is SIGKILLed by pid: the group must restart from the newest checkpoint and the run complete.

Two test modules read this one run (the session fixture ``killed_rank_run`` in this folder's conftest):
tests/distributed/test_rank_failure.py (the restart, the books) and test_async_sharded.py (an async run of
two rank actors learns, every task trained once). One run checked both ways instead of two runs: each was
one Ray start, four actor processes and a dozen steps (85 and 59 CPU-s on the loaded 2 cores, 2026-12-07).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _runs import DEFAULT_CONFIG, SHARDED_ASYNC

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 12
KILL_AFTER_STEP = 6  # after the step-4 checkpoint; 6 steps left for the restart to happen in
OVERRIDES = (*SHARDED_ASYNC, f"trainer.steps={STEPS}", "trainer.checkpoint_every=4", "task.num_eval=32")


@dataclass(frozen=True)
class KilledRankRun:
    """What the tests read: the CLI's exit code and output, the run folder's ``summary.json``, and the
    trainer ranks' pids before the kill and at the end (``trainer_ranks.json``)."""

    returncode: int
    output: str
    summary: dict
    pids_before: list[int]
    pids_after: list[int]


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


def run_with_killed_rank(out: Path, init: Path) -> KilledRankRun:
    """Start the run into ``out`` from the policy folder ``init``, kill trainer rank 1 after step
    ``KILL_AFTER_STEP``, wait for the CLI to exit (the module docstring)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", "import sys; from moerl.cli import main; sys.exit(main(sys.argv[1:]))"]
    args = ["train", "--config", str(DEFAULT_CONFIG)]
    for o in (f"output_dir={out}", f"init_from={init}", "name=kill", *OVERRIDES):
        args += ["--set", o]
    proc = subprocess.Popen(
        [*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        run = _wait_for(lambda: next(iter(out.glob("kill-*")), None), 120, proc, "the run folder")
        _wait_for(
            lambda: _metric_steps(run) >= KILL_AFTER_STEP,
            300,
            proc,
            f"step {KILL_AFTER_STEP} (after the step-4 checkpoint)",
        )
        before = json.loads((run / "trainer_ranks.json").read_text())["pids"]
        os.kill(before[1], signal.SIGKILL)  # a real death of trainer rank 1
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    summary_path = run / "summary.json"
    return KilledRankRun(
        returncode=proc.returncode,
        output=output,
        summary=json.loads(summary_path.read_text()) if summary_path.exists() else {},
        pids_before=before,
        pids_after=json.loads((run / "trainer_ranks.json").read_text())["pids"],
    )
