"""``moerl train --resume`` of a run whose newest checkpoint was damaged afterwards, from another working
folder than the one it started in with a relative ``init_from``: it skips the damaged checkpoint (one line
saying which and why), finds the init folder (stored absolute) and ends like the uninterrupted run."""

from __future__ import annotations

import os

import fsspec
from _runs import newest_run
from conftest import short_config

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.runtime.checkpoint import list_checkpoints, newest_complete_checkpoint
from moerl.runtime.run_dir import read_jsonl
from moerl.runtime.storage import RunStorage
from moerl.tasks import sft
from moerl.telemetry.metrics import without_wall_clock
from moerl.train import resume, train


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
    assert "tasks duplicated 0 lost 0;" in err[-1] and err[-1].startswith("[")  # the live view's last line
    summary = run.read_summary()
    assert summary["steps"] == 4 and summary["tasks_duplicated"] == summary["tasks_lost"] == 0
    assert [without_wall_clock(r) for r in read_jsonl(run.metrics)] == before
    assert summary["final_eval_accuracy"] == full["final_eval_accuracy"]
    assert newest_complete_checkpoint(run.path) == (run.path / "checkpoints" / "step_4", [])  # rewritten


def test_a_stored_run_resumed_on_another_machine_does_not_run_its_warm_start_again(tmp_path, monkeypatch):
    """No init_from: the SFT warm start is stored once as ``sft/`` and fetched back for the resume."""
    url = f"memory://moerl-sft-{id(tmp_path)}/runs"
    cfg = short_config(tmp_path / "a", None, "trainer.steps=2", "trainer.checkpoint_every=2")
    cfg.init_from = None
    cfg.sft.steps, cfg.sft.batch_size, cfg.sft.num_examples, cfg.sft.warmup_steps = 2, 4, 16, 0
    cfg.storage.url = url
    summary = train(cfg, live=False)
    stored = RunStorage(summary["storage_url"])
    assert "config.json" in stored.committed_files("sft")

    def no_second_warm_start(*args, **kwargs):
        raise AssertionError("the SFT warm start ran again on resume")

    monkeypatch.setattr(sft, "run_sft", no_second_warm_start)
    resumed = resume(summary["storage_url"], ["trainer.steps=4", f"output_dir={tmp_path / 'b'}"], live=False)
    assert resumed["steps"] == 4 and resumed["tasks_duplicated"] == resumed["tasks_lost"] == 0
    fsspec.filesystem("memory").rm(url.removeprefix("memory://").split("/")[0], recursive=True)
