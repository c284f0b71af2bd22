"""Async mode with a sharded trainer: 2 trainer ranks as Ray actors (gloo, EP 2) next to one rollout worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from _runs import DEFAULT_CONFIG, SHARDED_ASYNC, run_config

from moerl.train import train


@pytest.fixture
def ray_session(monkeypatch):
    """Ray workers (started by this test's ray.init) import the reward function from this folder."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    yield
    ray.shutdown()


def short_default(tmp_path, init, *overrides):
    """configs/default.yaml shortened: 12 steps of 4 groups x 8, a learnable reward, one rollout worker."""
    return run_config(
        DEFAULT_CONFIG,
        tmp_path,
        init,
        *SHARDED_ASYNC,
        "trainer.steps=12",
        "trainer.checkpoint_every=8",
        "task.num_eval=32",
        *overrides,
    )


@pytest.mark.timeout(400)
def test_async_run_with_two_rank_actors_learns_exactly_once(tmp_path, default_init, ray_session):
    cfg = short_default(tmp_path, default_init)
    summary = train(cfg, live=False)
    print(
        {
            k: summary[k]
            for k in ("start_eval_accuracy", "final_eval_accuracy", "tasks_duplicated", "tasks_lost")
        }
    )
    assert summary["status"] == "completed" and summary["mode"] == "async" and summary["steps"] == 12
    assert summary["trainer_ranks"] == 2 and len(set(summary["trainer_rank_pids"])) == 2
    assert summary["final_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.3
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
