"""Fixtures of the end-to-end tests: a tiny policy checkpoint and short run configs."""

import pytest
import torch

from moerl.config import load_config
from moerl.models import build_model, save_pretrained
from moerl.tasks import load_tokenizer

TINY_MODEL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_intermediate_size=32",
    "model.max_position_embeddings=64",
]


@pytest.fixture(scope="session")
def tiny_init(tmp_path_factory):
    """A fresh tiny MoE policy saved as a Hugging Face folder with the built-in tokenizer."""
    path = tmp_path_factory.mktemp("init") / "policy"
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = load_config(None, TINY_MODEL)
    save_pretrained(build_model(cfg.model, tok.vocab_size), path)
    tok.save(path)
    return path


def short_config(tmp_path, init, *overrides):
    """A run config of a few small sync steps from ``init`` (overrides win)."""
    return load_config(
        None,
        [
            *TINY_MODEL,
            f"output_dir={tmp_path}",
            f"init_from={init}",
            "runtime.mode=sync",
            "trainer.steps=3",
            "trainer.batch_groups=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "rollout.max_slots=8",
            "rollout.kv_token_budget=512",
            "task.num_eval=16",
            "eval.every=0",
            "trainer.checkpoint_every=0",
            *overrides,
        ],
    )
