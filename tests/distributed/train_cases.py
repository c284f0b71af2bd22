"""Short ``moerl train`` runs (sync mode, float32) of a tiny 8-expert policy at several trainer layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moerl.config import load_config
from moerl.rundir.folder import read_jsonl
from moerl.tasks.sft import run_sft
from moerl.train import train
from moerl.weights.store import WeightStore

TINY_MOE = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=8",
    "model.top_k=2",
    "model.moe_intermediate_size=16",
    "model.max_position_embeddings=64",
]


def warm_start(folder: Path) -> Path:
    """A 15-step SFT warm start (it emits the stop token, so response lengths vary)."""
    cfg = load_config(
        None, [*TINY_MOE, "sft.steps=15", "sft.batch_size=32", "sft.num_examples=1000", "sft.warmup_steps=5"]
    )
    torch.manual_seed(0)
    run_sft(cfg, out_dir=str(folder))
    return folder


def run_config(out: Path, init: Path, name: str, *overrides: str):
    """5 sync steps of 4 groups x 4 samples, token-mean GRPO on the odd-length reward."""
    return load_config(
        None,
        [
            *TINY_MOE,
            f"output_dir={out}",
            f"init_from={init}",
            f"name={name}",
            "runtime.mode=sync",
            "trainer.steps=5",
            "trainer.batch_groups=4",
            "trainer.micro_batch_size=8",
            "trainer.lr=1e-4",  # the default; Adam moves near-zero-gradient weights by ~lr, so their
            # float32 rounding differences grow with lr (measured 1.06e-5 relative at 1e-3, lm_head)
            "trainer.checkpoint_every=3",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "rollout.max_slots=16",
            "rollout.kv_token_budget=512",
            "algorithm.aggregation=token-mean",
            "task.reward_fn=dist_rewards:odd_length",
            "task.num_eval=8",
            "eval.every=0",
            *overrides,
        ],
    )


def run(cfg) -> dict:
    """Train; the summary, each step's metrics and the last published weights."""
    summary = train(cfg, live=False)
    folder = max(Path(cfg.output_dir).glob(f"{cfg.name}-*"), key=lambda p: p.stat().st_mtime)
    version, weights = WeightStore(str(folder / "weights")).load_latest()
    return {
        "summary": summary,
        "metrics": read_jsonl(folder / "metrics.jsonl"),
        "version": version.version,
        "weights": weights,
        "folder": folder,
        "config": json.dumps(summary.get("fleet", {})),
    }
