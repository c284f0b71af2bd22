"""A step's ``TrainBatch`` cut into one slice per data-parallel rank, whole groups kept together.

Advantages are computed by ``build_train_batch`` over the whole batch before the cut (a group's
baseline needs all of its samples, and the cut never splits a group anyway). Each slice carries its
own loss-token and sequence counts; the ranks all-reduce them into the step's global normalizers
(``ShardedTrainer``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moerl.trainer.batch import TrainBatch


def rank_groups(num_groups: int, num_ranks: int, mini_batches: int = 1) -> list[list[int]]:
    """The group indices each rank trains: the batch's groups are cut into ``mini_batches`` consecutive
    mini-batches (as ``TrainBatch.mini_batches`` cuts them at one rank), and each mini-batch into
    ``num_ranks`` consecutive equal parts; rank r gets part r of every mini-batch, in order. So the
    rank's own ``mini_batches(M)`` are its parts, and mini-batch j over all ranks is the one-rank
    trainer's mini-batch j (the same optimizer steps).

    Raises:
        ValueError: ``num_groups`` is not a multiple of ``num_ranks * mini_batches`` (every rank must run
            as many micro-batches, each with its collectives, and hold an equal part of each mini-batch).
    """
    if num_groups % (num_ranks * mini_batches):
        raise ValueError(
            f"split_by_groups: {num_groups} groups do not split evenly over {num_ranks} ranks x "
            f"{mini_batches} mini-batches"
        )
    per_part = num_groups // (num_ranks * mini_batches)
    per_mini = per_part * num_ranks
    return [
        [m * per_mini + r * per_part + i for m in range(mini_batches) for i in range(per_part)]
        for r in range(num_ranks)
    ]


def split_by_groups(batch: TrainBatch, num_ranks: int, mini_batches: int = 1) -> list[TrainBatch]:
    """``num_ranks`` slices of ``batch``, whole groups each (``rank_groups``: with one mini-batch, rank r
    gets groups ``[r G / R, (r + 1) G / R)`` of the G groups).

    Raises:
        ValueError: G is not a multiple of ``num_ranks * mini_batches`` (``rank_groups``), or the batch
            already carries fields the ranks compute (reference log-probs, critic values, proximal
            log-probs).
    """
    computed = [
        n
        for n in ("ref_logprobs", "old_values", "returns", "proximal_logprobs")
        if getattr(batch, n) is not None
    ]
    if computed:
        raise ValueError(f"split_by_groups: the batch already has {computed}; the ranks compute them")
    out = []
    for groups in rank_groups(len(batch.task_ids), num_ranks, mini_batches):
        picked = torch.tensor(groups, dtype=torch.int64)
        rows = torch.isin(batch.group_ids, picked).nonzero().squeeze(1)  # groups ascending: rows in order
        local_ids = torch.full((len(batch.task_ids),), -1, dtype=torch.int64)
        local_ids[picked] = torch.arange(len(groups))
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
                group_ids=local_ids[batch.group_ids[rows]],
                policy_versions=batch.policy_versions[rows],
                num_tokens=int(loss_mask.sum()),
                num_seqs=int(loss_mask.any(dim=1).sum()),
                task_ids=tuple(batch.task_ids[g] for g in groups),
                lease_tokens=tuple(batch.lease_tokens[g] for g in groups),
                group_versions=tuple(batch.group_versions[g] for g in groups),
                prompt_lens=None if batch.prompt_lens is None else batch.prompt_lens[rows],
                routed_experts=None if batch.routed_experts is None else batch.routed_experts[rows],
            )
        )
    return out
