"""``moerl train --resume`` of a run whose newest checkpoint was damaged afterwards, from another working
folder than the one it started in with a relative ``init_from``: it skips the damaged checkpoint (one line
saying which and why), finds the init folder (stored absolute) and ends like the uninterrupted run."""

from __future__ import annotations

import errno
import os

import fsspec
from _runs import newest_run
from conftest import short_config

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.rundir.folder import read_jsonl
from moerl.rundir.storage import RunStorage
from moerl.tasks import sft
from moerl.telemetry.metrics import without_wall_clock
from moerl.train import resume, train
from moerl.trainer.checkpoint import list_checkpoints, newest_complete_checkpoint
from moerl.weights.store import WeightStore


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


def test_a_garbled_summary_does_not_block_the_resume(tmp_path, tiny_init, capsys):
    """summary.json cut by hand or a full disk: the checkpoints decide, the summary is said to be ignored."""
    cfg = short_config(tmp_path / "runs", tiny_init, "trainer.steps=2", "trainer.checkpoint_every=2")
    train(cfg, live=False)
    run = newest_run(cfg)
    run.summary.write_text('{"status": "completed", "steps": 2')  # cut short
    capsys.readouterr()
    assert cli_main(["train", "--resume", str(run.path), "--set", "trainer.steps=3"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"moerl: {run.summary}: not valid JSON (Expecting ',' delimiter: line 1 column 35 (char 34)); "
        "resuming as a run that has not finished"
    ), err
    summary = run.read_summary()  # rewritten whole at the end
    assert summary["steps"] == 3 and summary["tasks_duplicated"] == summary["tasks_lost"] == 0


def test_a_full_disk_stops_the_run_with_the_resume_hint(tmp_path, tiny_init, monkeypatch, capsys):
    """ENOSPC while writing weight version 3 (after the step-2 checkpoint): one line naming the file and
    the resume command, exit 1 (not a config error); the resume it names then completes the run."""
    import moerl.cli

    cfg = short_config(
        tmp_path / "runs",
        tiny_init,
        "trainer.steps=4",
        "trainer.checkpoint_every=2",
        "runtime.durable_every=1",
    )  # every version written (in the background): version 3's write finds the disk full
    real_write = WeightStore._write_file

    def write_until_full(self, vdir, name, shard):
        if vdir.endswith("v00000003"):
            raise OSError(errno.ENOSPC, "No space left on device", f"{vdir}/{name}")
        return real_write(self, vdir, name, shard)

    monkeypatch.setattr(moerl.cli, "_config", lambda args: cfg)
    monkeypatch.setattr(WeightStore, "_write_file", write_until_full)
    capsys.readouterr()
    assert cli_main(["train"]) == 1
    run = newest_run(cfg)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"moerl: no space left on device writing {run.weights}/v00000003/model.safetensors; free space and "
        f"continue with: moerl train --resume {run.path}"
    ), err
    monkeypatch.setattr(WeightStore, "_write_file", real_write)  # space freed
    assert cli_main(["train", "--resume", str(run.path)]) == 0
    assert run.read_summary()["steps"] == 4
