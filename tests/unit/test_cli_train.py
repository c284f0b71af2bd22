"""``moerl train``: --ray-address goes through the validated overrides (fresh runs and --resume alike)."""

from __future__ import annotations

import pytest

import moerl.runtime.controller as controller
from moerl.cli import main


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


def test_bad_override_is_a_config_error_before_any_run(calls, capsys):
    assert main(["train", "--set", "trainer.lr=-1"]) == 2
    assert "config error" in capsys.readouterr().err and "cfg" not in calls
