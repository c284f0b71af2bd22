"""The global-batch pieces of the trainer algorithms: whitening and explained variance through a
rank-sum ``reduce`` (identity at one rank), and which groups each data-parallel rank trains."""

import pytest
import torch

from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.rl import explained_variance, whiten
from moerl.trainer.batch import build_train_batch
from moerl.trainer.critic import global_explained_variance, global_whiten, masked_mean_var
from moerl.trainer.distributed.batching import rank_groups, split_by_groups


def test_global_whiten_and_explained_variance_at_one_rank_match_moerl_rl():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    mask = torch.rand(5, 7, generator=gen) < 0.6
    assert torch.allclose(global_whiten(x, mask), whiten(x, mask), atol=1e-6)
    assert global_explained_variance(v, x, mask) == pytest.approx(explained_variance(v, x, mask), abs=1e-9)
    mean, var = masked_mean_var(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[True, True, False]]))
    assert (mean, var) == (2.0, 1.0)
    assert torch.equal(global_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


def test_masked_mean_var_sums_through_reduce():
    calls = []

    def reduce(t):  # another rank holding the same entries: every sum doubles
        calls.append(t.clone())
        return 2 * t

    mean, var = masked_mean_var(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2, dtype=torch.bool), reduce)
    assert (mean, var) == (2.0, 1.0) and len(calls) == 2  # count+sum, then squared deviations
    assert calls[0].tolist() == [2.0, 4.0] and calls[1].tolist() == [2.0]


def test_rank_groups_give_each_rank_part_of_every_mini_batch():
    assert rank_groups(4, 2) == [[0, 1], [2, 3]]
    assert rank_groups(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="6 groups do not split evenly over 2 ranks x 2 mini-batches"):
        rank_groups(6, 2, 2)


def _group(i: int) -> Group:
    task = RolloutTask(task_id=f"t{i}", prompt_ids=(1, 2), prompt_text="p", answer="a", num_samples=2)
    samples = [
        Sample(
            prompt_ids=(1, 2),
            response_ids=(3,) * (1 + i % 3),
            response_logprobs=(-1.0,) * (1 + i % 3),
            loss_mask=(1,) * (1 + i % 3),
            finish_reason="stop",
            policy_versions=(0,) * (1 + i % 3),
            reward=float(j),
        )
        for j in range(2)
    ]
    return Group.from_lease(Lease(task, "w", i + 1, 0.0), samples, 0.0)


def test_split_slices_mini_batches_are_the_global_mini_batches_parts():
    batch = build_train_batch([_group(i) for i in range(8)], pad_id=0)
    slices = split_by_groups(batch, 2, 2)
    assert [s.task_ids for s in slices] == [("t0", "t1", "t4", "t5"), ("t2", "t3", "t6", "t7")]
    for m, mini in enumerate(batch.mini_batches(2)):
        parts = [s.mini_batches(2)[m] for s in slices]
        assert parts[0].task_ids + parts[1].task_ids == mini.task_ids
        assert sum(p.num_tokens for p in parts) == mini.num_tokens
        assert torch.equal(torch.cat([p.rewards for p in parts]), mini.rewards)
    assert slices[1].group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
