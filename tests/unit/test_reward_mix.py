"""How a reward model's score joins the verifiable reward (hand-computed values), and the scoring step
between a worker and the buffer with a stand-in scorer."""

import pytest
import torch

from moerl.config import RewardConfig
from moerl.records import Group, RolloutTask, Sample
from moerl.rl.reward_mix import mix_rewards
from moerl.runtime.reward import RewardStats, ScoringSink, score_groups

V = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
S = torch.tensor([[3.0, 1.0], [2.0, 2.0]])


def test_combines_and_normalizations_by_hand():
    assert mix_rewards(V, S, combine="sum", normalize="none", task_weight=2.0, model_weight=0.5).tolist() == [
        [3.5, 0.5], [1.0, 1.0]]  # fmt: skip
    assert mix_rewards(V, S, combine="model", normalize="none").tolist() == [[3.0, 1.0], [2.0, 2.0]]
    group = mix_rewards(V, S, combine="model", normalize="group")  # (3, 1): mean 2, std 1; (2, 2): std 0
    assert group.flatten().tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    batch = mix_rewards(V, S, combine="model", normalize="batch")  # mean 2, std sqrt(0.5)
    assert batch.flatten().tolist() == pytest.approx([2**0.5, -(2**0.5), 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="same"):
        mix_rewards(V, S[:1], combine="sum", normalize="none")


def _group(task_id: str, rewards: list[float], responses: list[tuple[int, ...]]) -> Group:
    task = RolloutTask(
        task_id=task_id, prompt_ids=(7, 8), prompt_text="", answer="", num_samples=len(rewards)
    )
    samples = [
        Sample(
            prompt_ids=(7, 8),
            response_ids=r,
            response_logprobs=(0.0,) * len(r),
            loss_mask=(1,) * len(r),
            finish_reason="stop",
            policy_versions=(0,) * len(r),
            reward=v,
        )  # fmt: skip
        for v, r in zip(rewards, responses, strict=True)
    ]
    return Group(task=task, lease_token=3, worker_id="w", samples=tuple(samples), min_policy_version=0,
                 gen_seconds=0.1, num_tokens=8)  # fmt: skip


class LengthScorer:
    """Stands in for the reward model: the score is the sequence's length."""

    def __init__(self):
        self.stats, self.calls = RewardStats(), []

    def score(self, sequences):
        self.calls.append(sequences)
        scores = [float(len(s)) for s in sequences]
        self.stats.add_batch(scores, 0.5)
        return scores


def test_score_groups_mixes_each_sample_and_keeps_the_lease():
    groups = [_group("a", [1.0, 0.0], [(1,), (1, 2, 3)]), _group("b", [0.0, 1.0], [(4, 5), (6,)])]
    scorer = LengthScorer()
    cfg = RewardConfig(model_path="x", combine="sum", normalize="none", task_weight=1.0, model_weight=0.5)
    out = score_groups(groups, scorer, cfg)
    assert scorer.calls == [
        [[7, 8, 1], [7, 8, 1, 2, 3], [7, 8, 4, 5], [7, 8, 6]]
    ]  # prompt + response, in order
    assert [g.rewards for g in out] == [(2.5, 2.5), (2.0, 2.5)]
    assert out[0].samples[1].reward_info == {"verifiable": 0.0, "model_score": 5.0}
    assert [(g.task_id, g.lease_token, g.worker_id) for g in out] == [("a", 3, "w"), ("b", 3, "w")]
    group_norm = score_groups(
        groups, scorer, RewardConfig(model_path="x", combine="model", normalize="group")
    )
    assert [g.rewards for g in group_norm] == [
        pytest.approx((-1.0, 1.0), abs=1e-5),
        pytest.approx((1.0, -1.0), abs=1e-5),
    ]


def test_scoring_sink_scores_before_the_buffer_and_stats_window():
    got = []

    class Buffer:
        def put_many_async(self, groups, *, timeout=None):
            got.extend(groups)
            return "pending"

    scorer = LengthScorer()
    sink = ScoringSink(Buffer(), scorer, RewardConfig(model_path="x", combine="model"))
    assert sink.put_many_async([_group("a", [1.0, 0.0], [(1,), (1, 2)])], timeout=1.0) == "pending"
    assert got[0].rewards == (3.0, 4.0)
    values = scorer.stats.take()
    assert values["reward/batch_size"] == 2 and values["reward/latency_s"] == 0.5
    assert values["reward/score_mean"] == 3.5 and values["reward/score_std"] == pytest.approx(0.5)
    scorer.stats.add_loss(lost_worker=True)
    after = scorer.stats.take()  # a new window: no batch since, the losses are cumulative
    assert after["reward/score_mean"] is None and after["reward/workers_lost"] == 1 == after["reward/retries"]


def test_rollout_workers_share_one_gpu_with_reward_workers():
    from moerl.runtime.ray.reward_pool import rollout_gpu_share

    assert rollout_gpu_share(8, 4, 2.0) == 1.0  # room for both: a whole GPU each
    assert rollout_gpu_share(1, 1, 0.25) == 0.75  # one GPU: what the reward worker leaves
    assert rollout_gpu_share(1, 2, 0.5) == 0.25
    with pytest.raises(ValueError, match="leave none to the rollout workers"):
        rollout_gpu_share(1, 1, 1.0)
