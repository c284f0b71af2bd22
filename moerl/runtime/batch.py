"""A step's groups as one padded batch: ``TrainBatch`` and ``build_train_batch``.

Shapes: B sequences of the step (groups x n), T the longest prompt + response. Per-token tensors are
``[B, T]`` and aligned with ``input_ids`` as ``moerl.rl.token_logprobs`` returns them: position t
describes token t (predicted from the logits at t - 1), position 0 is never trained.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from moerl.rl import group_advantages
from moerl.runtime.types import Group


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """A step's groups as padded tensors plus the step's global loss normalizers.

    Rows are the samples of the groups in order (group g holds rows ``g*n .. g*n + n - 1`` for
    equal group sizes). Sequences are right-padded with ``pad_id``.
    """

    input_ids: torch.Tensor
    """[B, T] int64: prompt then response tokens, right-padded."""
    attention_mask: torch.Tensor
    """[B, T] int64: 1 at prompt and response tokens, 0 at padding."""
    loss_mask: torch.Tensor
    """[B, T] bool: True at response tokens that enter the loss (``Sample.loss_mask``)."""
    behaviour_logprobs: torch.Tensor
    """[B, T] float32: rollout-engine log-probs of the response tokens; 0 elsewhere."""
    advantages: torch.Tensor
    """[B] float32: one advantage per sequence (``moerl.rl.group_advantages``)."""
    rewards: torch.Tensor
    """[B] float32: the samples' rewards."""
    group_ids: torch.Tensor
    """[B] int64: index of the sample's group in the batch."""
    policy_versions: torch.Tensor
    """[B] int64: oldest policy version that generated each sample."""
    num_tokens: int
    """Loss tokens (``loss_mask`` set) over the whole step: the token-mean normalizer."""
    num_seqs: int
    """Sequences of the step with at least one loss token: the sequence-mean normalizer."""
    task_ids: tuple[str, ...]
    """Task id of each group, in group order."""
    lease_tokens: tuple[int, ...]
    """Fencing token under which each group was delivered."""
    group_versions: tuple[int, ...]
    """``min_policy_version`` of each group."""
    prompt_lens: torch.Tensor | None = None
    """[B] int64: prompt tokens of each row; lets the trainer run each group's prompt once
    (``moerl.runtime.shared_prefix``). None: every row is forwarded whole."""

    @property
    def num_sequences(self) -> int:
        """Rows B (sequences, padded or not)."""
        return self.input_ids.shape[0]

    def micro_batches(self, size: int) -> Iterator[TrainBatch]:
        """Consecutive slices of at most ``size`` rows, each cut to its own longest sequence.

        The slices keep the step's global ``num_tokens`` / ``num_seqs``, so their losses add up to
        the step's loss.
        """
        for start in range(0, self.num_sequences, size):
            rows = slice(start, start + size)
            length = int(self.attention_mask[rows].sum(dim=1).max())
            cols = slice(0, max(length, 2))
            yield replace(
                self,
                input_ids=self.input_ids[rows, cols],
                attention_mask=self.attention_mask[rows, cols],
                loss_mask=self.loss_mask[rows, cols],
                behaviour_logprobs=self.behaviour_logprobs[rows, cols],
                advantages=self.advantages[rows],
                rewards=self.rewards[rows],
                group_ids=self.group_ids[rows],
                policy_versions=self.policy_versions[rows],
                prompt_lens=None if self.prompt_lens is None else self.prompt_lens[rows],
            )


def build_train_batch(groups: Sequence[Group], *, pad_id: int, estimator: str = "grpo") -> TrainBatch:
    """Pad the groups' samples into a ``TrainBatch`` and compute group-relative advantages.

    Args:
        groups: the step's groups (at least one).
        pad_id: token id used for right padding (never trained: attention_mask 0, loss_mask False).
        estimator: ``moerl.rl.group_advantages`` estimator: grpo, dr_grpo or rloo.

    Raises:
        ValueError: no groups, or an estimator that needs a value model (gae).
    """
    if not groups:
        raise ValueError("build_train_batch: no groups")
    samples = [s for g in groups for s in g.samples]
    num = len(samples)
    prompt_len = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.int64)  # (B,)
    response_len = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64)  # (B,)
    seq_len = prompt_len + response_len
    length = max(int(seq_len.max()), 2)
    cols = torch.arange(length)
    # Boolean-mask assignment fills True cells in row-major order, i.e. sample after sample, which is
    # the order of the flat token lists below: one tensor op per field instead of a loop over rows.
    is_token = cols < seq_len[:, None]  # (B, T)
    is_response = is_token & (cols >= prompt_len[:, None])  # (B, T)
    input_ids = torch.full((num, length), pad_id, dtype=torch.int64)
    input_ids[is_token] = torch.tensor(
        [t for s in samples for t in (*s.prompt_ids, *s.response_ids)], dtype=torch.int64
    )
    loss_mask = torch.zeros(num, length, dtype=torch.bool)
    loss_mask[is_response] = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool)
    behaviour = torch.zeros(num, length, dtype=torch.float32)
    behaviour[is_response] = torch.tensor(
        [x for s in samples for x in s.response_logprobs], dtype=torch.float32
    )
    attention_mask = is_token.long()
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = torch.repeat_interleave(
        torch.arange(len(groups)), torch.tensor([len(g.samples) for g in groups], dtype=torch.int64)
    )
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=group_advantages(rewards, group_ids, estimator=estimator),
        rewards=rewards,
        group_ids=group_ids,
        policy_versions=torch.tensor([s.min_policy_version for s in samples], dtype=torch.int64),
        num_tokens=int(loss_mask.sum()),
        num_seqs=int(loss_mask.any(dim=1).sum()),
        task_ids=tuple(g.task_id for g in groups),
        lease_tokens=tuple(g.lease_token for g in groups),
        group_versions=tuple(g.min_policy_version for g in groups),
        prompt_lens=prompt_len,
    )
