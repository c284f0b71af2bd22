"""The run-folder lock: one process runs or resumes a run folder; a second ``moerl train --resume`` of it
fails in one line (exit 2) and touches nothing; a killed holder's lock is free again (``RunFolderLock``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import moerl.train as controller
from moerl.cli import main
from moerl.config import ConfigError, RunConfig
from moerl.errors import RunFolderInUseError
from moerl.rundir.folder import LedgerEntry, RunDir, RunFolderLock

HOLD = (
    "import sys, time\n"
    "from moerl.rundir.folder import RunFolderLock\n"
    "RunFolderLock(sys.argv[1]).acquire()\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)
"""A second process that takes a run folder's lock the way ``moerl train`` does, then holds it."""


def _run_with_records(tmp_path) -> RunDir:
    """A run folder with 20 steps of metrics and ledger and a checkpoint after step 10."""
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    run.metrics.write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 21)))
    run.append_ledger([LedgerEntry(f"t{s}", s, s - 1, s) for s in range(1, 21)])
    (run.checkpoint_dir(10)).mkdir()
    (run.checkpoint_dir(10) / "meta.json").write_text("{}")
    return run


def _snapshot(path: Path) -> dict:
    return {
        str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


@pytest.fixture
def holder(tmp_path):
    """Start a process holding the lock of a fresh run folder; yields (run, process); kills it at the end."""
    run = _run_with_records(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run.path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_resume_of_a_folder_in_use_fails_in_one_line_and_touches_nothing(holder, capsys):
    run, proc = holder
    before = _snapshot(run.path)
    assert main(["train", "--resume", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert err == f"moerl: run folder {run.path} is in use by another moerl process (pid {proc.pid})\n"
    assert _snapshot(run.path) == before  # not rewound: metrics and ledger of all 20 steps kept


def test_a_killed_holder_leaves_the_folder_free(holder):
    run, proc = holder
    with pytest.raises(RunFolderInUseError, match=f"pid {proc.pid}"):
        RunFolderLock(run.path).acquire()
    proc.send_signal(signal.SIGKILL)  # as kill -9: the OS drops its flock
    proc.wait(timeout=30)
    with RunFolderLock(run.path):
        assert (run.path / "run.lock").read_text() == ""  # never written: only flock-ed
    with RunFolderLock(run.path):  # released on exit: taken again
        pass


def _lock_seen_by_start(monkeypatch) -> list:
    """Replace ``Run.start`` by a probe that tries to take the folder's lock itself, then stops the run."""
    seen = []

    def probe(self, checkpoint):
        try:
            RunFolderLock(self.dir.path).acquire().release()
            seen.append("free")
        except RunFolderInUseError as e:
            seen.append(str(e))
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(controller.Run, "start", probe)
    return seen


def test_a_fresh_run_holds_the_lock_of_its_new_folder(tmp_path, monkeypatch):
    seen = _lock_seen_by_start(monkeypatch)
    with pytest.raises(ConfigError, match="stopped by the test"):
        controller.train(RunConfig(output_dir=str(tmp_path)), live=False)
    assert len(seen) == 1 and f"(pid {os.getpid()})" in seen[0]


def test_a_resume_holds_the_lock_until_it_ends(tmp_path, monkeypatch):
    run = _run_with_records(tmp_path)
    seen = _lock_seen_by_start(monkeypatch)
    monkeypatch.setattr(controller, "check_init_from", lambda *a: None)
    monkeypatch.setattr(controller, "resume_checkpoint", lambda folder, cfg: run.checkpoint_dir(10))
    for _ in range(2):  # the first resume gave the lock back: a second one in this process takes it
        with pytest.raises(ConfigError, match="stopped by the test"):
            controller.resume(run.path, live=False)
    assert len(seen) == 2 and all(f"run folder {run.path} is in use" in s for s in seen)


def test_two_fresh_runs_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(time, "strftime", lambda *a: "20260101-000000")
    cfg = RunConfig(output_dir=str(tmp_path))
    first, second = RunDir.create(cfg), RunDir.create(cfg)
    assert first.path != second.path and second.path.name == f"{first.path.name}-1"
