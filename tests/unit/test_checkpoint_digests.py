"""meta.json records each checkpoint file's size and xxh3-128 digest (the sharded DCP folder's files too); a
file changed after the write (a flipped byte, a model re-saved with NaN, a JSON part edited) is a damaged
checkpoint named by its file, skipped by the resume in favour of the older good one; a checkpoint
written before the records existed loads unchecked."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors.torch import load_file, save_file

from moerl.config import ConfigError, load_config
from moerl.run.resume import resume_checkpoint
from moerl.trainer.checkpoint import (
    checkpoint_problem,
    load_checkpoint,
    newest_complete_checkpoint,
    save_checkpoint,
)

RUN = load_config(None, ["trainer.steps=300"])  # a run whose checkpoints are at steps 100 and 200
CHANGED = "does not match its xxh3_128 digest in meta.json (written "


def _state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # gradients by hand: no autograd set-up cost
        p.grad = torch.ones_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": step}}


def _two_checkpoints(tmp_path):
    return [save_checkpoint(tmp_path, step, _state(step)) for step in (100, 200)]


def _meta(folder) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _flip_byte(path, index: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


def _nan_model(folder) -> None:
    """Re-save model.safetensors with every value NaN: a valid file with the same keys, shapes and size."""
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: torch.full_like(t, float("nan")) for k, t in tensors.items()}, str(folder / "model.safetensors")
    )


def test_each_file_size_and_digest_is_recorded(tmp_path):
    folder = save_checkpoint(tmp_path, 3, _state(3))
    files = _meta(folder)["files"]
    on_disk = {p.name for p in folder.iterdir()} - {"meta.json"}
    assert (
        set(files)
        == on_disk
        == {
            "model.json",
            "model.safetensors",
            "optimizer.json",
            "optimizer.safetensors",
            "trainer.json",
        }
    )
    for name, record in files.items():
        data = (folder / name).read_bytes()
        assert record == {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    assert "sharded_files" not in _meta(folder)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _flip_byte(d / "model.safetensors"), f"model.safetensors {CHANGED}"),
        (lambda d: _flip_byte(d / "optimizer.safetensors", -20), f"optimizer.safetensors {CHANGED}"),
        (_nan_model, f"model.safetensors {CHANGED}"),
        (lambda d: (d / "trainer.json").write_text('{"step": 900}'), f"trainer.json {CHANGED}"),
        (
            lambda d: (d / "trainer.json").write_text('{"step": 2000}'),
            "trainer.json is 14 bytes, meta.json records 13 (changed after the write)",
        ),
    ],
    ids=["flipped-model-byte", "flipped-optimizer-byte", "nan-model", "edited-json", "resized-json"],
)
def test_a_file_changed_after_the_write_is_damage_named_by_its_file(tmp_path, damage, reason):
    older, newest = _two_checkpoints(tmp_path)
    size = (newest / "model.safetensors").stat().st_size
    damage(newest)
    assert (newest / "model.safetensors").stat().st_size == size  # the structure alone looks whole
    problem = checkpoint_problem(newest)
    assert problem is not None and problem.startswith(reason) and "\n" not in problem
    found, skipped = newest_complete_checkpoint(tmp_path)
    assert found == older and skipped == [f"checkpoints/step_200: {problem}"]
    with pytest.raises(ValueError, match=f"step_200 is not a complete checkpoint: {reason[:30]}"):
        load_checkpoint(newest)


def test_the_nan_model_was_valid_and_would_have_loaded_without_its_digest(tmp_path):
    """The NaN case is not caught by the structure: the same file in a checkpoint without records loads."""
    _, newest = _two_checkpoints(tmp_path)
    _nan_model(newest)
    meta = _meta(newest)
    del meta["files"]  # as written before digests were recorded
    (newest / "meta.json").write_text(json.dumps(meta))
    assert checkpoint_problem(newest) is None
    assert load_checkpoint(newest)["model"]["weight"].isnan().all()


def test_a_checkpoint_without_records_still_loads(tmp_path):
    folder = save_checkpoint(tmp_path, 5, _state(5))
    want = load_checkpoint(folder)
    meta = _meta(folder)
    (folder / "meta.json").write_text(
        json.dumps(
            {k: meta[k] for k in ("format", "step", "parts", "created_at")}
        )  # format moerl-checkpoint/1
    )
    assert checkpoint_problem(folder) is None
    assert newest_complete_checkpoint(tmp_path) == (folder, [])
    got = load_checkpoint(folder)
    assert got["trainer"] == {"step": 5}
    assert all(torch.equal(got["model"][k], t) for k, t in want["model"].items())


def test_unreadable_records_are_damage(tmp_path):
    folder = save_checkpoint(tmp_path, 1, _state(1))
    meta = _meta(folder)
    meta["files"] = {"model.safetensors": {"xxh3_128": "ab"}}  # no size
    (folder / "meta.json").write_text(json.dumps(meta))
    assert checkpoint_problem(folder) == "meta.json has unreadable file records for the step folder"
    meta["files"] = {"gone.json": {"size": 3}}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert checkpoint_problem(folder) == "gone.json missing (meta.json records it)"
    (folder / "gone.json").mkdir()  # a folder where a file was recorded: unreadable, not an exception
    meta["files"] = {"gone.json": {"size": (folder / "gone.json").stat().st_size, "xxh3_128": "ab"}}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert checkpoint_problem(folder) == "gone.json unreadable (Is a directory)"


def test_resume_falls_back_to_the_older_good_checkpoint_with_one_line(tmp_path, capsys):
    older, newest = _two_checkpoints(tmp_path)
    _nan_model(newest)
    assert resume_checkpoint(tmp_path, RUN) == older
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"moerl: checkpoints/step_200: model.safetensors {CHANGED}")
    assert err[0].endswith("changed after the checkpoint was written; resuming from step_100")
    _flip_byte(older / "optimizer.safetensors", -5)
    with pytest.raises(FileNotFoundError) as e:
        resume_checkpoint(tmp_path, RUN)
    message = str(e.value)
    assert message.startswith(f"{tmp_path} has no complete checkpoint to resume from: checkpoints/step_200:")
    assert f"; checkpoints/step_100: optimizer.safetensors {CHANGED}" in message


def test_a_sharded_checkpoint_records_and_checks_its_dcp_files(tmp_path):
    shards = tmp_path / "checkpoints" / "shards" / "step_2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(shards), no_dist=True)
    step = save_checkpoint(tmp_path, 2, {"sharded": {"path": "shards/step_2"}, "trainer": {"step": 2}})
    records = _meta(step)["sharded_files"]
    assert set(records) == {p.name for p in shards.iterdir()} and {".metadata", "__0_0.distcp"} <= set(
        records
    )
    for name, record in records.items():
        data = (shards / name).read_bytes()
        assert record == {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    assert checkpoint_problem(step) is None
    _flip_byte(shards / "__0_0.distcp")
    problem = checkpoint_problem(step)
    assert problem is not None and problem.startswith(f"shards/step_2/__0_0.distcp {CHANGED}")


def test_a_resume_below_the_checkpoints_step_is_refused(tmp_path):
    _two_checkpoints(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer.steps=150 is below .* \(step_200\).*>= 200"):
        resume_checkpoint(tmp_path, load_config(None, ["trainer.steps=150"]))
    assert resume_checkpoint(tmp_path, load_config(None, ["trainer.steps=200"])).name == "step_200"
