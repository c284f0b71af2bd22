"""A step's ``TrainBatch`` cut into one slice per data-parallel rank, whole groups kept together.

Advantages are computed by ``build_train_batch`` over the whole batch before the cut (a group's
baseline needs all of its samples, and the cut never splits a group anyway). Each slice carries its
own loss-token and sequence counts; the ranks all-reduce them into the step's global normalizers
(``ShardedTrainer``).
"""

from __future__ import annotations

from dataclasses import replace

from moerl.runtime.batch import TrainBatch


def split_by_groups(batch: TrainBatch, num_ranks: int) -> list[TrainBatch]:
    """``num_ranks`` slices of ``batch``: rank r gets groups ``[r G / R, (r + 1) G / R)`` (G groups).

    Raises:
        ValueError: G is not a multiple of ``num_ranks`` (every rank must run as many micro-batches,
            since each one runs collectives).
    """
    num_groups = len(batch.task_ids)
    if num_groups % num_ranks:
        raise ValueError(f"split_by_groups: {num_groups} groups do not split evenly over {num_ranks} ranks")
    per_rank = num_groups // num_ranks
    out = []
    for r in range(num_ranks):
        first, stop = r * per_rank, (r + 1) * per_rank
        rows = ((batch.group_ids >= first) & (batch.group_ids < stop)).nonzero().squeeze(1)
        loss_mask = batch.loss_mask[rows]
        out.append(
            replace(
                batch,
                input_ids=batch.input_ids[rows],
                attention_mask=batch.attention_mask[rows],
                loss_mask=loss_mask,
                behaviour_logprobs=batch.behaviour_logprobs[rows],
                advantages=batch.advantages[rows],
                rewards=batch.rewards[rows],
                group_ids=batch.group_ids[rows] - first,
                policy_versions=batch.policy_versions[rows],
                num_tokens=int(loss_mask.sum()),
                num_seqs=int(loss_mask.any(dim=1).sum()),
                task_ids=batch.task_ids[first:stop],
                lease_tokens=batch.lease_tokens[first:stop],
                group_versions=batch.group_versions[first:stop],
                prompt_lens=None if batch.prompt_lens is None else batch.prompt_lens[rows],
            )
        )
    return out
