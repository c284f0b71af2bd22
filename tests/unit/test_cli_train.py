"""``moerl train``: --ray-address goes through the validated overrides (fresh runs and --resume alike); a
full disk is one line, exit 1."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import moerl.train as controller
from moerl.cli import main
from moerl.config import ConfigError
from moerl.errors import DiskFullError


@pytest.fixture
def calls(monkeypatch, tmp_path):
    seen = {}

    def fake_train(cfg):
        seen["cfg"] = cfg
        return {"status": "completed"}

    def fake_resume(run_dir, overrides=None):
        seen["resume"] = (run_dir, list(overrides or []))
        return {"status": "completed"}

    monkeypatch.setattr(controller, "train", fake_train)
    monkeypatch.setattr(controller, "resume", fake_resume)
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: built-in defaults
    (tmp_path / "runs" / "x").mkdir(parents=True)  # a run folder to resume (the CLI checks it first)
    (tmp_path / "runs" / "x" / "config.yaml").write_text("{}\n")
    return seen


def test_ray_address_reaches_the_config_verbatim(calls):
    # "10:30" would be the YAML 1.1 integer 630 if it were not quoted
    assert main(["train", "--ray-address", "10:30", "--set", "runtime.mode=async"]) == 0
    assert calls["cfg"].runtime.ray_address == "10:30"
    assert main(["train", "--ray-address", "ray://head:10001"]) == 0
    assert calls["cfg"].runtime.ray_address == "ray://head:10001"


def test_resume_honours_ray_address(calls):
    assert main(["train", "--resume", "runs/x", "--ray-address", "auto", "--set", "trainer.steps=9"]) == 0
    assert calls["resume"] == ("runs/x", ["trainer.steps=9", 'runtime.ray_address="auto"'])


def test_file_urls_name_local_run_folders(calls, monkeypatch, tmp_path):
    import moerl.telemetry.report as report

    run = f"{tmp_path}/runs/x"
    assert main(["train", "--resume", f"file://{run}"]) == 0  # storage.url=file://... runs are local
    assert calls["resume"] == (run, [])
    monkeypatch.setattr(report, "report_main", lambda run_dir: calls.setdefault("report", run_dir) and 0)
    assert main(["report", f"file://{run}"]) == 0 and calls["report"] == run


def test_bad_override_is_a_config_error_before_any_run(calls, capsys):
    assert main(["train", "--set", "trainer.lr=-1"]) == 2
    assert "config error" in capsys.readouterr().err and "cfg" not in calls


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--set", "trainer.stpes=10"], "unknown config key 'trainer.stpes'; did you mean 'trainer.steps'?"),
        (["--resume", "no_such_run"], "no_such_run does not exist (no run folder to resume)"),
        (["--resume", "."], ". is not a run folder (no config.yaml)"),
        (["--resume", "f.yaml"], "f.yaml is a file, not a run folder"),
        (["--resume", ""], "--resume is empty: name a run folder"),  # "$RUN" unset: no fresh run instead
        (["--config", ""], "--config is empty: name a YAML file"),
    ],
    ids=[
        "config-typo",
        "resume-missing",
        "resume-not-a-run",
        "resume-a-file",
        "resume-empty",
        "config-empty",
    ],
)
def test_a_bad_train_input_is_reported_before_torch_loads(tmp_path, argv, line):
    """The one-line error of a config typo, an empty --config or --resume, or a wrong local --resume folder
    comes before torch (tens of seconds to import on a busy machine) and the runtime are loaded."""
    import subprocess
    import sys

    (tmp_path / "f.yaml").write_text("{}\n")
    code = f"import sys; from moerl.cli import main; rc = main(['train', *{argv!r}]); print(rc, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)
    assert line in out.stderr


def test_unreachable_ray_address_fails_fast_with_one_line(tmp_path, capsys):
    import socket

    from moerl.runtime.ray import check_ray_address

    with pytest.raises(ConfigError, match="cannot reach 127.0.0.1:1"):
        check_ray_address("127.0.0.1:1", timeout_s=2.0)
    with pytest.raises(ConfigError, match="expected host:port"):
        check_ray_address("ray://head:port")
    check_ray_address("auto")  # left to Ray
    with socket.socket() as listener:  # something listening: accepted
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        check_ray_address(f"127.0.0.1:{listener.getsockname()[1]}")
    assert main(["train", "--ray-address", "127.0.0.1:1", "--set", f"output_dir={tmp_path}"]) == 2
    assert "cannot reach 127.0.0.1:1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # failed before the warm start; no run folder left


@pytest.fixture
def no_sft(monkeypatch, tmp_path):
    import moerl.tasks.sft as sft

    def must_not_run(*args, **kwargs):
        raise AssertionError("training started although the output folder cannot be written")

    monkeypatch.setattr(sft, "run_sft", must_not_run)
    monkeypatch.chdir(tmp_path)


def test_sft_out_under_a_file_fails_before_training(tmp_path, no_sft, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert main(["sft", "--out", str(blocker / "ckpt")]) == 2
    assert f"Not a directory: {blocker}" in capsys.readouterr().err


def test_sft_out_in_a_read_only_folder_fails_before_training(tmp_path, no_sft, capsys):
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits
            pytest.skip("this user can write to a 0500 folder")
        assert main(["sft", "--out", str(locked / "ckpt")]) == 2
        assert f"Permission denied: {locked}" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_sft_out_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path, no_sft, capsys):
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("keep me")
    assert main(["sft", "--out", str(notes.parent)]) == 2
    assert "exists and is not a model folder" in capsys.readouterr().err
    assert notes.read_text() == "keep me"
    assert main(["sft", "--out", str(notes)]) == 2  # a file
    assert notes.read_text() == "keep me"


def test_sft_out_may_replace_an_earlier_checkpoint(tmp_path, monkeypatch):
    import moerl.tasks.sft as sft

    calls = []
    monkeypatch.setattr(sft, "run_sft", lambda cfg, out_dir, progress=None: calls.append(out_dir))
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "ckpt"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "sft_summary.json").write_text("{}")  # what marks a folder as a moerl sft output
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["sft", "--out", str(old), "--set", "sft.steps=1"]) == 0
    assert main(["sft", "--out", str(empty), "--set", "sft.steps=1"]) == 0
    assert calls == [str(old), str(empty)]


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            DiskFullError(
                OSError(errno.ENOSPC, "No space left on device", "/r/weights/x"), Path("/r"), False
            ),
            "moerl: no space left on device writing /r/weights/x before the first checkpoint: /r holds the "
            "metrics so far but cannot be resumed",
        ),
        (
            DiskFullError(OSError(errno.EDQUOT, "Disk quota exceeded"), None, False),
            "moerl: disk quota exceeded writing a file before the first step (no run folder left); free space "
            "and start again",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "runs/x/config.yaml"),
            "moerl: no space left on device writing runs/x/config.yaml; free space and try again",
        ),
    ],
)
def test_a_full_disk_is_one_line_exit_1(monkeypatch, tmp_path, error, line, capsys):
    def full(cfg):
        raise error

    monkeypatch.setattr(controller, "train", full)
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == line + "\n"


def test_another_os_error_is_not_taken_for_a_full_disk(monkeypatch, tmp_path):
    def broken(cfg):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(controller, "train", broken)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match="Input/output error"):
        main(["train"])


def test_a_refused_weight_version_in_sync_mode_is_one_line_exit_1(monkeypatch, tmp_path, capsys):
    from moerl.errors import WeightVersionRefused

    def refused(cfg):
        raise WeightVersionRefused("refused weight version 2 (its tensor table does not match)")

    monkeypatch.setattr(controller, "train", refused)
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == "moerl: refused weight version 2 (its tensor table does not match)\n"
