"""A fresh run that fails before its first trainer step leaves no run folder behind."""

from __future__ import annotations

import pytest

from moerl.config import ConfigError, RunConfig
from moerl.rundir.folder import RunDir
from moerl.telemetry.metrics import MetricsWriter


def _fresh(tmp_path) -> RunDir:
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    (run.path / "sft").mkdir()  # what a warm start leaves before failing
    (run.path / "sft" / "config.json").write_text("{}")
    return run


def test_failure_before_the_first_step_removes_the_folder(tmp_path):
    run = _fresh(tmp_path)
    with pytest.raises(ConfigError, match="init_from"), run.discarded_on_early_failure():
        raise ConfigError("init_from='nope' is not a Hugging Face model folder")
    assert not run.path.exists() and list(tmp_path.iterdir()) == []


def test_output_dir_made_by_the_run_goes_with_it_one_there_before_stays(tmp_path):
    made = RunDir.create(RunConfig(output_dir=str(tmp_path / "a" / "runs")))
    assert made.discard_if_unstarted() and list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    there = RunDir.create(RunConfig(output_dir=str(tmp_path / "kept")))
    assert there.discard_if_unstarted() and (tmp_path / "kept").is_dir()


def test_interrupt_before_the_first_step_removes_the_folder(tmp_path):
    run = _fresh(tmp_path)
    with pytest.raises(KeyboardInterrupt), run.discarded_on_early_failure():
        raise KeyboardInterrupt
    assert not run.path.exists()


def test_a_run_with_a_recorded_step_or_a_checkpoint_is_kept(tmp_path):
    run = _fresh(tmp_path)
    MetricsWriter(run.metrics).write(1, 0.5, {"rollout/reward_mean": 0.1})
    with pytest.raises(RuntimeError), run.discarded_on_early_failure():
        raise RuntimeError("worker died at step 2")
    assert run.has_started() and run.config.exists()

    other = _fresh(tmp_path)
    other.checkpoint_dir(3).mkdir()
    assert other.has_started() and not other.discard_if_unstarted() and other.path.exists()


def test_success_keeps_the_folder(tmp_path):
    run = _fresh(tmp_path)
    with run.discarded_on_early_failure() as same:
        assert same is run
    assert run.path.exists() and not run.has_started()
    assert run.discard_if_unstarted() and not run.path.exists()


def test_train_with_a_bad_init_from_leaves_no_folder_and_resume_creates_none(tmp_path):
    from moerl.train import resume, train

    cfg = RunConfig(output_dir=str(tmp_path / "runs"), init_from=str(tmp_path / "no-such-model"))
    cfg.runtime.mode = "sync"
    with pytest.raises(ConfigError, match="init_from"):
        train(cfg, live=False)
    assert not (tmp_path / "runs").exists()  # output_dir, made by this run alone, went with it
    with pytest.raises(FileNotFoundError, match="typo does not exist"):
        resume(tmp_path / "typo", live=False)
    assert not (tmp_path / "typo").exists()


def test_resume_of_a_short_finished_run_says_it_is_complete_and_without_a_checkpoint_says_why(
    tmp_path, capsys
):
    from moerl.train import resume

    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))  # trainer.steps=40, checkpoint_every=10
    run.write_summary({"status": "completed", "steps": 40})
    assert resume(run.path, live=False)["steps"] == 40
    out = capsys.readouterr().out
    # no checkpoint was written, so it does not suggest extending it (that would fail, as below)
    assert "already complete (40 steps)" in out and "no checkpoint to continue from" in out
    assert "--set trainer.steps=N" not in out
    with pytest.raises(FileNotFoundError, match=r"checkpoint_every=10: the first is written at step 10"):
        resume(run.path, ["trainer.steps=80"], live=False)
    with pytest.raises(FileNotFoundError, match=r"checkpoint_every=0: checkpoints are off"):
        resume(run.path, ["trainer.steps=80", "trainer.checkpoint_every=0"], live=False)
