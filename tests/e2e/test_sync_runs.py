"""Sync mode end to end: reproducibility, resume equality, accounting, bad input, report."""

import json
import math
from pathlib import Path

import pytest
import torch
from _runs import newest_run
from conftest import short_config

from moerl.cli import main as cli_main
from moerl.config import ConfigError
from moerl.rundir.folder import read_jsonl
from moerl.telemetry.metrics import METRIC_KEYS, without_wall_clock
from moerl.train import resume, train
from moerl.trainer.checkpoint import list_checkpoints
from moerl.trainer.local import lr_factor
from moerl.weights.store import WeightStore

DIGIT_REWARD = "task.reward_fn=e2e_rewards:first_is_digit"


def _run(cfg):
    """Train and return the summary and the (newest) run folder."""
    summary = train(cfg, live=False)
    return summary, newest_run(cfg)


def _metrics(run):
    return [without_wall_clock(r) for r in read_jsonl(run.metrics)]


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory, tiny_init):
    """Two sync runs of one config (3 steps, evals at step 2, a cosine schedule, ``durable_every`` far off):
    ``(cfg, (summary, run), (summary, run))``. Read by the reproducibility and last-version tests."""
    tmp_path = tmp_path_factory.mktemp("twins")
    cfg = short_config(
        tmp_path, tiny_init, "trainer.steps=3", "eval.every=2", "trainer.lr=1e-3", DIGIT_REWARD,
        "trainer.warmup_steps=2", "trainer.lr_schedule=cosine", "runtime.durable_every=100",
    )  # fmt: skip
    return cfg, _run(cfg), _run(cfg)


@pytest.mark.xdist_group("sync_twin_runs")  # one worker builds twin_runs once
def test_sync_runs_are_bit_for_bit_reproducible(twin_runs):
    cfg, (s1, r1), (s2, r2) = twin_runs
    m1, m2 = _metrics(r1), _metrics(r2)
    assert len(m1) == 3 and set(read_jsonl(r1.metrics)[0]) == {"step", "wall_s", *METRIC_KEYS}
    assert m1 == m2  # every metric, every step, bit for bit
    assert m1[1]["eval/accuracy"] is not None and m1[0]["eval/accuracy"] is None
    assert any(m["train/grad_norm"] > 0 for m in m1)
    cfg_t = cfg.trainer  # the step's learning rate as its schedule gives it (steps 0, 1, 2 of the schedule)
    assert [m["train/lr"] for m in m1] == pytest.approx([cfg_t.lr * lr_factor(cfg_t, s) for s in range(3)])
    assert [e.task_id for e in r1.read_ledger()] == [e.task_id for e in r2.read_ledger()]
    w1, w2 = (WeightStore(str(r.weights)).load_latest()[1] for r in (r1, r2))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert s1["tasks_duplicated"] == s1["tasks_lost"] == 0 and s1["tasks_trained"] == 6


@pytest.mark.xdist_group("sync_twin_runs")  # one worker builds twin_runs once
def test_the_last_version_is_made_durable_as_its_own_timing_not_as_a_hand_off(twin_runs):
    """The run's last version goes to the store at its last step (durable_every far off), timed as
    ``timing/final_save_s`` (0 on the other steps), apart from ``timing/publish_s`` (the hand-off).
    The first of ``twin_runs``: 3 steps, ``runtime.durable_every=100``."""
    cfg, (_, run), _ = twin_runs
    assert cfg.trainer.steps == 3 and cfg.runtime.durable_every == 100
    rows = read_jsonl(run.metrics)
    assert [r["timing/final_save_s"] > 0 for r in rows] == [False, False, True]
    assert WeightStore(str(run.weights)).versions() == [0, 3]  # version 0 and the last: nothing else due


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, tiny_init):
    common = [
        "eval.every=2",
        "trainer.lr=1e-3",
        "trainer.checkpoint_every=2",
        "trainer.warmup_steps=3",
        DIGIT_REWARD,
    ]
    _, full = _run(short_config(tmp_path / "full", tiny_init, "trainer.steps=4", *common))
    _, part = _run(short_config(tmp_path / "part", tiny_init, "trainer.steps=2", *common))
    assert [s for s, _ in list_checkpoints(part.path)] == [2]
    summary = resume(part.path, ["trainer.steps=4"], live=False)
    assert summary["steps"] == 4 and summary["tasks_duplicated"] == summary["tasks_lost"] == 0
    assert _metrics(part) == _metrics(full)
    assert [e.task_id for e in part.read_ledger()] == [e.task_id for e in full.read_ledger()]


def test_summary_accounting_matches_the_ledger(tmp_path, tiny_init):
    summary, run = _run(short_config(tmp_path, tiny_init, "trainer.steps=4", "trainer.batch_groups=3"))
    ledger = run.read_ledger()
    ids = [e.task_id for e in ledger]
    assert len(ids) == len(set(ids)) == 12 == summary["tasks_trained"]
    assert summary["tasks_leased"] == summary["tasks_acked"] == 12  # sync: every lease delivered
    assert [e.step for e in ledger] == [s for s in (1, 2, 3, 4) for _ in range(3)]
    assert summary["tasks_lost"] == summary["tasks_duplicated"] == 0
    assert json.loads(run.summary.read_text()) == summary
    assert cli_main(["report", str(run.path)]) == 0 and run.report.exists()


def test_invalid_config_and_unwritable_store_are_clear_errors(tmp_path, tiny_init, capsys):
    assert cli_main(["train", "--set", "trainer.lr=-1"]) == 2
    assert "trainer.lr=-1" in capsys.readouterr().err
    assert cli_main(["train", "--set", "trainer.stpes=3"]) == 2
    assert "did you mean 'trainer.steps'" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = short_config(tmp_path, tiny_init, f"runtime.store_url={blocker}/weights")
    with pytest.raises(ConfigError, match="runtime.store_url.*cannot be written"):
        train(cfg, live=False)


def test_a_reward_raising_on_every_sample_of_step_one_stops_the_run(tmp_path, tiny_init):
    # issue 38: it used to score 0 and train on; now the run stops before training on zeros, folder removed
    from moerl.errors import RewardFunctionError

    cfg = short_config(tmp_path, tiny_init, "trainer.steps=2", "task.reward_fn=e2e_rewards:raising_reward")
    with pytest.raises(
        RewardFunctionError, match="failed on all 8 samples of the first step.*reward service down"
    ):
        train(cfg, live=False)
    runs = Path(cfg.output_dir)
    assert not runs.exists() or list(runs.iterdir()) == []


def test_nan_loss_steps_are_skipped_then_the_run_stops(tmp_path, tiny_init, monkeypatch):
    import moerl.trainer.local as trainer_mod

    real = trainer_mod.policy_loss

    def nan_after_first_step(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return (loss * math.nan if nan_after_first_step.calls >= 2 else loss), metrics

    nan_after_first_step.calls = 0
    original_step = trainer_mod.LocalTrainer.train_step

    def counting_step(self, batch):
        nan_after_first_step.calls += 1
        return original_step(self, batch)

    monkeypatch.setattr(trainer_mod, "policy_loss", nan_after_first_step)
    monkeypatch.setattr(trainer_mod.LocalTrainer, "train_step", counting_step)
    cfg = short_config(
        tmp_path, tiny_init, "trainer.steps=10", "trainer.max_nan_steps=3", "trainer.checkpoint_every=1"
    )
    summary, run = _run(cfg)
    assert summary["status"] == "stopped" and "3 trainer steps in a row" in summary["stop_reason"]
    assert summary["skipped_steps"] == 3 and summary["steps"] == 3  # step 1 trained; 2, 3 skipped; 4 stops
    records = read_jsonl(run.metrics)
    assert [r["train/grad_norm"] is None for r in records] == [False, True, True]
    # only complete checkpoints and weight versions are visible, and they verify
    assert [s for s, _ in list_checkpoints(run.path)] == [2, 3]
    assert not list(run.checkpoints.glob("*.tmp*"))
    store = WeightStore(str(run.weights))
    for version in store.versions():
        store.load(version)  # checks every file's sha256


def test_finished_run_exports_its_policy_and_a_second_resume_changes_nothing(tmp_path, tiny_init):
    from moerl.models import from_pretrained

    summary, run = _run(short_config(tmp_path, tiny_init, "trainer.steps=2", "trainer.checkpoint_every=2"))
    policy = Path(summary["policy"])
    assert policy == run.path / "policy" and (policy / "tokenizer.json").is_file()
    exported = from_pretrained(policy).state_dict()
    stored = WeightStore(str(run.weights)).load_latest()[1]  # the trainer's last published weights
    assert all(torch.equal(exported[k], stored[k]) for k in stored)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "12+34="}\n')
    out = tmp_path / "o.jsonl"
    assert cli_main(["generate", "--model", str(policy), "--prompts", str(prompts), "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1
    before = run.summary.read_text()
    assert resume(run.path, live=False) == json.loads(before)  # already complete: nothing runs
    assert run.summary.read_text() == before


def test_interrupt_names_the_run_to_resume_only_when_it_can_be_resumed(tmp_path, tiny_init, monkeypatch):
    from moerl.trainer.local import LocalTrainer

    real_step = LocalTrainer.train_step

    def step_then_interrupt(self, batch):
        if self.step == 2:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(LocalTrainer, "train_step", step_then_interrupt)
    cfg = short_config(tmp_path / "a", tiny_init, "trainer.steps=4", "trainer.checkpoint_every=2")
    with pytest.raises(KeyboardInterrupt) as info:
        train(cfg, live=False)
    (run_path,) = Path(cfg.output_dir).glob("run-*")
    assert info.value.run_dir == run_path and list_checkpoints(run_path)[0][0] == 2
    cfg = short_config(tmp_path / "b", tiny_init, "trainer.steps=4", "trainer.checkpoint_every=0")
    with pytest.raises(KeyboardInterrupt) as info:
        train(cfg, live=False)
    assert info.value.run_dir is None  # two steps were recorded but no checkpoint: nothing to resume
    (partial,) = Path(cfg.output_dir).glob("run-*")
    assert info.value.partial_run_dir == partial


def test_sigterm_stops_the_run_like_ctrl_c(tmp_path, tiny_init, monkeypatch):
    import os
    import signal

    from moerl.trainer.local import LocalTrainer

    real_step = LocalTrainer.train_step
    sent = []

    def step_then_sigterm(self, batch):
        if self.step == 2 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stopping the job would
        return real_step(self, batch)

    monkeypatch.setattr(LocalTrainer, "train_step", step_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    cfg = short_config(tmp_path, tiny_init, "trainer.steps=6", "trainer.checkpoint_every=2")
    with pytest.raises(KeyboardInterrupt) as info:
        train(cfg, live=False)
    (run_path,) = Path(cfg.output_dir).glob("run-*")
    assert info.value.run_dir == run_path and list_checkpoints(run_path)[0][0] == 2
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only
    assert resume(run_path, live=False)["steps"] == 6


def test_cli_interrupt_hint_names_the_real_folder(monkeypatch, capsys, tmp_path):
    import moerl.train as controller

    def interrupted(cfg, live=True):
        raise controller.RunInterrupted(tmp_path / "runs" / "default-1", resumable=True)

    monkeypatch.setattr(controller, "train", interrupted)
    assert cli_main(["train", "--set", f"output_dir={tmp_path}"]) == 130
    assert f"moerl train --resume {tmp_path / 'runs' / 'default-1'}" in capsys.readouterr().err


def test_cli_interrupt_before_the_first_checkpoint_says_it_cannot_be_resumed(monkeypatch, capsys, tmp_path):
    import moerl.train as controller

    def interrupted(cfg, live=True):
        raise controller.RunInterrupted(tmp_path / "runs" / "default-1", resumable=False)

    monkeypatch.setattr(controller, "train", interrupted)
    assert cli_main(["train", "--set", f"output_dir={tmp_path}"]) == 130
    err = capsys.readouterr().err
    assert f"{tmp_path / 'runs' / 'default-1'} holds the metrics so far but cannot be resumed" in err
    assert "--resume" not in err
