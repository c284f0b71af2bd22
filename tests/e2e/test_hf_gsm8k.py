"""`moerl train` on a GSM8K-format JSONL with a Hugging Face checkpoint folder saved by transformers."""

from pathlib import Path

import pytest
import torch
import transformers

from moerl.cli import main as cli_main
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.tasks import load_tokenizer

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} not present")
def test_gsm8k_jsonl_with_hf_checkpoint_runs_end_to_end(tmp_path):
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    folder = tmp_path / "hf"
    transformers.Qwen3MoeForCausalLM(hf_cfg).save_pretrained(folder)
    tok.save(folder)
    code = cli_main(
        [
            "train",
            "--set",
            f"init_from={folder}",
            "--set",
            f"output_dir={tmp_path / 'runs'}",
            "--set",
            "task.name=jsonl",
            "--set",
            f"task.path={GSM8K}",
            "--set",
            "task.num_eval=8",
            "--set",
            "runtime.mode=sync",
            "--set",
            "trainer.steps=2",
            "--set",
            "trainer.batch_groups=2",
            "--set",
            "rollout.group_size=2",
            "--set",
            "rollout.max_new_tokens=8",
            "--set",
            "rollout.max_slots=4",
            "--set",
            "rollout.kv_token_budget=4096",
            "--set",
            "eval.every=0",
            "--set",
            "trainer.checkpoint_every=2",
        ]
    )
    assert code == 0
    (run_path,) = (tmp_path / "runs").iterdir()
    run = RunDir(run_path)
    summary = run.read_summary()
    records = read_jsonl(run.metrics)
    assert summary["status"] == "completed" and summary["steps"] == 2 and len(records) == 2
    assert summary["tasks_trained"] == 4 and summary["tasks_lost"] == summary["tasks_duplicated"] == 0
    assert all(r["train/grad_norm"] is not None for r in records)  # trained, maybe on zero advantages
    assert 0.0 <= summary["final_eval_accuracy"] <= 1.0
    assert (run.checkpoints / "step_2" / "meta.json").exists() and run.report.exists()
