"""Bad input to the distributed trainer: one clear line, exit code 2, nothing written."""

from __future__ import annotations

import torch

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.models import build_model, save_pretrained
from moerl.runtime.checkpoint import list_checkpoints
from moerl.tasks import load_tokenizer

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


def test_resume_with_shards_of_another_model_is_one_line_and_changes_nothing(tmp_path, capsys):
    init = _policy(tmp_path / "init")
    other = _policy(tmp_path / "other", "model.moe_intermediate_size=24")
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
