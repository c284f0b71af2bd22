"""Bad input to the distributed trainer: one clear line, exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.models import build_model, save_pretrained
from moerl.tasks import load_tokenizer
from moerl.trainer.checkpoint import checkpoint_problem, list_checkpoints

MODEL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_intermediate_size=16",
    "model.max_position_embeddings=64",
]


def _policy(folder, *overrides):
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    save_pretrained(build_model(load_config(None, [*MODEL, *overrides]).model, tok.vocab_size), folder)
    tok.save(folder)
    return folder


def _sets(*overrides):
    return [x for o in overrides for x in ("--set", o)]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A finished 2-rank (EP 2) run with one sharded checkpoint (step 2): (tmp folder, init, run folder)."""
    tmp_path = tmp_path_factory.mktemp("sharded_run")
    init = _policy(tmp_path / "init")
    common = [
        f"output_dir={tmp_path / 'runs'}",
        "name=r",
        "runtime.mode=sync",
        "trainer.num_ranks=2",
        "trainer.ep_size=2",
        "trainer.steps=2",
        "trainer.batch_groups=2",
        "trainer.checkpoint_every=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=3",
        "rollout.max_slots=4",
        "rollout.kv_token_budget=128",
        "task.num_eval=4",
        "eval.every=0",
    ]
    assert cli_main(["train", *_sets(*MODEL, f"init_from={init}", *common)]) == 0
    (run,) = (tmp_path / "runs").glob("r-*")
    return tmp_path, init, run


def test_resume_with_shards_of_another_model_is_one_line_and_changes_nothing(sharded_run, capsys):
    tmp_path, _, run = sharded_run
    other = _policy(tmp_path / "other", "model.moe_intermediate_size=24")
    assert [s for s, _ in list_checkpoints(run)] == [2]
    files = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = cli_main(["train", "--resume", str(run), *_sets(f"init_from={other}", "trainer.steps=3")])
    err = capsys.readouterr().err.strip()
    print(err)
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("moerl: config error:")
    assert "experts.gate_up_proj has shape (4, 32, 32) in the checkpoint; the model has (4, 48, 32)" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == files  # nothing written


def test_more_ranks_than_gpus_is_a_config_error_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = _sets(
        *MODEL,
        f"output_dir={tmp_path}",
        "runtime.mode=sync",
        "model.device=cuda",
        "trainer.num_ranks=2",
        "trainer.ep_size=2",
        "trainer.batch_groups=2",
    )
    code = cli_main(["train", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "trainer.num_ranks=2 needs 2 GPUs (one per rank) but this machine has 1" in err
    assert list(tmp_path.iterdir()) == []


def test_a_shard_changed_after_the_checkpoint_is_damage_named_by_its_file(sharded_run, tmp_path, capsys):
    """Each rank's DCP file is recorded (size, xxh3-128) in the step folder's meta.json; one flipped byte in
    a shard makes the resume refuse in one line naming the file, before any work (nothing written)."""
    _, init, original = sharded_run
    run = tmp_path / original.name
    shutil.copytree(original, run)
    step, shards = run / "checkpoints" / "step_2", run / "checkpoints" / "shards" / "step_2"
    recorded = json.loads((step / "meta.json").read_text())["sharded_files"]
    assert set(recorded) == {p.relative_to(shards).as_posix() for p in shards.rglob("*") if p.is_file()}
    assert ".metadata" in recorded and sum(name.endswith(".distcp") for name in recorded) >= 2  # each rank's
    assert checkpoint_problem(step) is None
    shard = max((shards / name for name in recorded if name.endswith(".distcp")), key=lambda p: p.name)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    files = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = cli_main(["train", "--resume", str(run), *_sets(f"init_from={init}", "trainer.steps=3")])
    err = capsys.readouterr().err.strip()
    print(err)
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(
        f"moerl: {run} has no complete checkpoint to resume from: checkpoints/step_2: shards/step_2/"
        f"{shard.name} does not match its xxh3_128 digest in meta.json"
    )
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == files  # nothing written
