"""``moerl train --resume`` of a run whose newest checkpoint was damaged afterwards, from another working
folder than the one it started in with a relative ``init_from``: it skips the damaged checkpoint (one line
saying which and why), finds the init folder (stored absolute) and ends like the uninterrupted run."""

from __future__ import annotations

import os

from _runs import newest_run
from conftest import short_config

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.runtime.checkpoint import list_checkpoints, newest_complete_checkpoint
from moerl.runtime.run_dir import read_jsonl
from moerl.telemetry.metrics import without_wall_clock
from moerl.train import train


def test_resume_skips_a_truncated_newest_checkpoint_from_another_folder(
    tmp_path, tiny_init, monkeypatch, capsys
):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    relative = os.path.relpath(tiny_init, start)
    common = ["trainer.steps=4", "trainer.checkpoint_every=2", "eval.every=2", "trainer.lr=1e-3"]
    cfg = short_config(tmp_path / "runs", tiny_init, *common, f"init_from={relative}")
    assert cfg.init_from == relative
    full = train(cfg, live=False)
    run = newest_run(cfg)
    assert load_config(run.config).init_from == str(tiny_init.resolve())  # stored absolute
    before = [without_wall_clock(r) for r in read_jsonl(run.metrics)]
    assert [s for s, _ in list_checkpoints(run.path)] == [2, 4]
    (run.path / "summary.json").unlink()  # as if stopped right after its step-4 checkpoint
    weights = run.path / "checkpoints" / "step_4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])  # cut short on disk
    capsys.readouterr()

    monkeypatch.chdir(elsewhere)
    assert cli_main(["train", "--resume", str(run.path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()  # then the live view's lines
    assert err[0] == (
        "moerl: checkpoints/step_4: model.safetensors unreadable (invalid header length); resuming from step_2"
    )
    assert "resumed at step 2 from" in err[1]
    summary = run.read_summary()
    assert summary["steps"] == 4 and summary["tasks_duplicated"] == summary["tasks_lost"] == 0
    assert [without_wall_clock(r) for r in read_jsonl(run.metrics)] == before
    assert summary["final_eval_accuracy"] == full["final_eval_accuracy"]
    assert newest_complete_checkpoint(run.path) == (run.path / "checkpoints" / "step_4", [])  # rewritten
