"""Every loss preset, routing replay and the KL penalty run the main job's task end to end (sync)."""

import math

import pytest
from _runs import newest_run
from conftest import short_config

from moerl.cli import main as cli_main
from moerl.rundir.folder import read_jsonl
from moerl.train import train

MAIN_TASK = ["task.min_digits=2", "task.max_digits=2", "task.operations=[+]"]
# The tiny random policy never answers right (reward 0 everywhere: no advantage, and DAPO's dynamic
# sampling would wait forever); "the first token is a digit" varies within groups and moves the policy.
DIGIT_REWARD = "task.reward_fn=e2e_rewards:first_is_digit"


def _run(tmp_path, init, *overrides):
    cfg = short_config(tmp_path, init, *MAIN_TASK, DIGIT_REWARD, "trainer.lr=1e-3", *overrides)
    summary = train(cfg, live=False)
    run = newest_run(cfg)
    return summary, read_jsonl(run.metrics), run


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"])
def test_each_preset_runs_the_main_task(tmp_path, tiny_init, preset):
    summary, records, _ = _run(tmp_path, tiny_init, f"algorithm.preset={preset}", "trainer.steps=3")
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["tasks_lost"] == summary["tasks_duplicated"] == 0
    for r in records:  # mismatch figures every step; sync + same float32 model: engine == trainer
        assert math.isfinite(r["train/pg_loss"]) and r["train/is_weight_mean"] is not None
        assert r["train/rollout_logprob_abs_diff"] < 1e-3 and r["train/rollout_kl"] < 1e-4
        assert r["train/expert_load_max_min"] >= 1.0
        assert (r["train/value_loss"] is not None) == (preset == "ppo")


def test_kl_penalty_runs_with_kl_ref_rising_from_zero(tmp_path, tiny_init):
    _, records, run = _run(tmp_path, tiny_init, "algorithm.kl_coef=0.01", "trainer.steps=4")
    kls = [r["train/kl_ref"] for r in records]
    assert kls[0] == 0.0 and kls[-1] > 0.0, kls
    assert cli_main(["report", str(run.path)]) == 0


def test_routing_replay_and_ppo_epochs_run(tmp_path, tiny_init):
    summary, records, _ = _run(
        tmp_path,
        tiny_init,
        "algorithm.routing_replay=r3",
        "trainer.ppo_epochs=2",
        "trainer.mini_batches=2",
        "trainer.recompute_proximal=true",
    )
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-3 for r in records)
