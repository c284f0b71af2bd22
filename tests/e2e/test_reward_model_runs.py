"""Runs with a learned reward model: the policy learns what the reward model prefers (sync mode, in
process), and async reward workers lose none of their groups when one is killed mid-run."""

from pathlib import Path

import pytest
from conftest import short_config
from reward_models import save_digit_reward_model

from moerl.run.folder import RunDir, read_jsonl
from moerl.train import train

STEPS = 10
MARGIN = 1.0
"""Least rise of the mean reward-model score from the first 3 steps to the last 3. The fresh policy's
groups score about 6.4; this seed's run reached 7.8 (2026-12-02): the policy writes more digits."""


@pytest.fixture(scope="module")
def digit_rm(tmp_path_factory):
    return save_digit_reward_model(tmp_path_factory.mktemp("rm") / "digit_rm")


def _run(tmp_path, init, *overrides):
    summary = train(short_config(tmp_path, init, *overrides), live=False)
    run = RunDir(next(Path(tmp_path).glob("run-*")))
    return summary, run, read_jsonl(run.metrics)


@pytest.mark.timeout(240)
def test_sync_run_learns_what_the_reward_model_prefers(tmp_path, tiny_init, digit_rm):
    summary, run, records = _run(
        tmp_path, tiny_init, f"reward.model_path={digit_rm}", "reward.combine=model",
        f"trainer.steps={STEPS}", "trainer.batch_groups=4", "rollout.group_size=8", "trainer.lr=3e-2",
        "trainer.warmup_steps=0", "reward.batch_size=8",
    )  # fmt: skip
    scores = [r["reward/score_mean"] for r in records]
    rewards = [r["rollout/reward_mean"] for r in records]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last - first > MARGIN, (first, last, scores)
    assert rewards == pytest.approx(scores, abs=1e-5)  # combine: model -> the reward is the score
    assert all(r["reward/batch_size"] == 8 for r in records)  # 4 groups x 8 samples in batches of 8
    assert all(r["reward/latency_s"] > 0 for r in records)
    assert summary["tasks_duplicated"] == summary["tasks_lost"] == 0
    assert summary["tasks_trained"] == STEPS * 4
