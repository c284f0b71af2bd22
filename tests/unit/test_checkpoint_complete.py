"""A damaged newest checkpoint (a file cut short or deleted after the write) is skipped, named with the
reason, in favour of the newest complete one; ``--set`` of a field a resume does not apply and ``--config``
with ``--resume`` are refused in one line."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from moerl.cli import main as cli_main
from moerl.config import ConfigError, RunConfig
from moerl.run.resume import RESUME_FIELDS
from moerl.rundir.folder import RunDir
from moerl.train import resume
from moerl.trainer.checkpoint import (
    checkpoint_problem,
    latest_checkpoint,
    load_checkpoint,
    newest_complete_checkpoint,
    save_checkpoint,
)


def _state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": step}}


def _two_checkpoints(tmp_path):
    for step in (100, 200):
        save_checkpoint(tmp_path, step, _state(step))
    return tmp_path / "checkpoints" / "step_100", tmp_path / "checkpoints" / "step_200"


def _truncate(path, keep=50):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (
            lambda d: _truncate(d / "model.safetensors"),
            "model.safetensors unreadable (invalid header length)",
        ),
        (
            lambda d: _truncate(d / "model.safetensors", -8),
            "model.safetensors unreadable (incomplete metadata",
        ),
        (lambda d: (d / "optimizer.safetensors").unlink(), "optimizer.safetensors missing"),
        (lambda d: (d / "meta.json").unlink(), "meta.json missing"),
        (lambda d: _truncate(d / "optimizer.json", 10), "optimizer.json unreadable"),
        (lambda d: (d / "trainer.json").unlink(), "trainer.json missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason(tmp_path, damage, reason):
    older, newest = _two_checkpoints(tmp_path)
    assert checkpoint_problem(newest) is None and latest_checkpoint(tmp_path) == newest
    damage(newest)
    found, skipped = newest_complete_checkpoint(tmp_path)
    assert found == older and latest_checkpoint(tmp_path) == older
    assert len(skipped) == 1 and skipped[0].startswith(f"checkpoints/step_200: {reason}")
    assert load_checkpoint(older)["trainer"] == {"step": 100}  # what the resume then loads
    if reason != "meta.json missing":  # loaded anyway: one line, not a decoding traceback
        with pytest.raises(ValueError, match=f"step_200 is not a complete checkpoint: {reason[:20]}"):
            load_checkpoint(newest)


def test_a_safetensors_file_without_a_tensor_its_json_names_is_incomplete(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    save_file({"weight": torch.zeros(3, 4)}, str(newest / "model.safetensors"))  # "bias" gone
    assert checkpoint_problem(newest) == "model.safetensors lacks 1 tensor(s) of model.json, e.g. 'bias'"


def test_a_sharded_checkpoint_needs_its_dcp_metadata_and_shard_files(tmp_path):
    shards = tmp_path / "checkpoints" / "shards" / "step_2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(shards), no_dist=True)
    step = save_checkpoint(tmp_path, 2, {"sharded": {"path": "shards/step_2"}, "trainer": {"step": 2}})
    assert checkpoint_problem(step) is None
    (shards / "__0_0.distcp").unlink()
    assert checkpoint_problem(step) == "shards/step_2/__0_0.distcp missing"
    (shards / ".metadata").unlink()
    assert checkpoint_problem(step) == "shards/step_2/.metadata missing (shards not written completely)"


def test_no_complete_checkpoint_is_one_line_naming_each_damage(tmp_path):
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    older, newest = _two_checkpoints(run.path)
    (newest / "meta.json").unlink()
    (older / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as e:
        resume(run.path, live=False)
    assert str(e.value) == (
        f"{run.path} has no complete checkpoint to resume from: checkpoints/step_200: meta.json missing; "
        "checkpoints/step_100: optimizer.safetensors missing"
    )


def test_resume_refuses_a_set_of_a_field_it_does_not_apply(tmp_path):
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))  # no checkpoint: the check comes first
    with pytest.raises(ConfigError) as e:
        resume(run.path, ["trainer.steps=80", "model.hidden_size=128"], live=False)
    message = str(e.value)
    assert message.startswith(
        "--set model.hidden_size: a resumed run keeps its own config (model.hidden_size="
    )
    assert "\n" not in message and all(f in message for f in RESUME_FIELDS)
    same = RunConfig().model.hidden_size  # the run's own value: nothing changes, nothing to refuse
    for ok in (["trainer.steps=80", f"model.hidden_size={same}"], ["telemetry.metrics_port=0"]):
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            resume(run.path, ok, live=False)


def test_cli_refuses_config_with_resume(tmp_path, capsys):
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    other = tmp_path / "other.yaml"
    other.write_text(json.dumps({"trainer": {"lr": 0.5}}))
    assert cli_main(["train", "--resume", str(run.path), "--config", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"moerl: config error: --config {other} with --resume: a resumed run keeps its own")
    assert "trainer.steps" in err
