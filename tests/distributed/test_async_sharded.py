"""Async mode with a sharded trainer: 2 trainer ranks as Ray actors (gloo, EP 2) next to one rollout worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.models import build_model, save_pretrained
from moerl.tasks import load_tokenizer
from moerl.train import train

ray = pytest.importorskip("ray")
DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


@pytest.fixture
def ray_session(monkeypatch):
    """Ray workers (started by this test's ray.init) import the reward function from this folder."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fresh_default_policy(tmp_path_factory):
    """The default config's model, freshly initialized, as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("init") / "policy"
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    save_pretrained(build_model(load_config(DEFAULT).model, tok.vocab_size), path)
    tok.save(path)
    return path


def short_default(tmp_path, init, *overrides):
    """configs/default.yaml shortened: 24 steps of 4 groups x 8, a learnable reward, one rollout worker."""
    return load_config(
        DEFAULT,
        [
            f"output_dir={tmp_path}",
            f"init_from={init}",
            "trainer.steps=24",
            "trainer.batch_groups=4",
            "trainer.micro_batch_size=32",
            "trainer.lr=3e-3",
            "trainer.warmup_steps=0",
            "trainer.checkpoint_every=8",
            "rollout.num_workers=1",
            "rollout.max_new_tokens=4",
            "rollout.max_slots=32",
            "rollout.kv_token_budget=1024",
            "runtime.buffer_groups=8",
            "task.reward_fn=dist_rewards:first_is_digit",
            "task.num_eval=32",
            "eval.every=0",
            "trainer.num_ranks=2",
            "trainer.ep_size=2",
            *overrides,
        ],
    )


@pytest.mark.timeout(400)
def test_async_run_with_two_rank_actors_learns_exactly_once(tmp_path, fresh_default_policy, ray_session):
    cfg = short_default(tmp_path, fresh_default_policy)
    summary = train(cfg, live=False)
    print(
        {
            k: summary[k]
            for k in ("start_eval_accuracy", "final_eval_accuracy", "tasks_duplicated", "tasks_lost")
        }
    )
    assert summary["status"] == "completed" and summary["mode"] == "async" and summary["steps"] == 24
    assert summary["trainer_ranks"] == 2 and len(set(summary["trainer_rank_pids"])) == 2
    assert summary["final_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.3
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
