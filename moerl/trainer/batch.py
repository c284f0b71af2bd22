"""A step's groups as one padded batch: ``TrainBatch`` and ``build_train_batch``.

Shapes: B sequences of the step (groups x n), T the longest prompt + response, L_moe MoE layers, k
experts per token (top-k). Per-token tensors are ``[B, T]`` and aligned with ``input_ids`` as ``moerl.rl.token_logprobs`` returns them: position t
describes token t (predicted from the logits at t - 1), position 0 is never trained.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from moerl.records import Group
from moerl.rl import group_advantages


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
    """[B] float32: one advantage per sequence (``moerl.rl.group_advantages``), or [B, T] per token
    (GAE, ``moerl.trainer.critic``)."""
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
    (``moerl.trainer.shared_prefix``). None: every row is forwarded whole."""
    routed_experts: torch.Tensor | None = None
    """[B, T, L_moe, k] int64: the experts the rollout engine routed each token to (R3 routing replay),
    position t the token fed at t. The engine never feeds a row's last token, and padding is never fed:
    those positions hold experts 0..k-1, which cannot change any trained log-prob (a position's experts
    reach only its own and later positions, and neither is trained). None: not recorded."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] float32: frozen reference policy's log-probs of the tokens (KL penalty); None: no reference."""
    old_values: torch.Tensor | None = None
    """[B, T] float32: the critic's values V(s_t) at the step's start (estimator gae); None otherwise."""
    returns: torch.Tensor | None = None
    """[B, T] float32: GAE value targets (estimator gae); None otherwise."""
    proximal_logprobs: torch.Tensor | None = None
    """[B, T] float32: the trainer's log-probs at the step's start (``trainer.recompute_proximal``)."""

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
            yield self._rows(rows, slice(0, max(length, 2)))

    def mini_batches(self, num: int) -> list[TrainBatch]:
        """The batch cut into ``num`` mini-batches of whole groups (consecutive, sizes differing by at most
        one group), each with its own ``num_tokens`` / ``num_seqs``: one optimizer step each
        (``trainer.mini_batches``). ``num == 1`` returns ``[self]``.

        Raises:
            ValueError: ``num`` is not in [1, number of groups].
        """
        num_groups = len(self.task_ids)
        if not 1 <= num <= num_groups:
            raise ValueError(f"mini_batches: num={num} must be in [1, {num_groups}] (the batch's groups)")
        if num == 1:
            return [self]
        out = []
        for chunk in torch.arange(num_groups).tensor_split(num):
            g0, g1 = int(chunk[0]), int(chunk[-1]) + 1
            (idx,) = ((self.group_ids >= g0) & (self.group_ids < g1)).nonzero(as_tuple=True)
            rows = slice(int(idx[0]), int(idx[-1]) + 1)  # a group's rows are consecutive
            mini = self._rows(rows, slice(None))
            out.append(
                replace(
                    mini,
                    group_ids=mini.group_ids - g0,
                    num_tokens=int(mini.loss_mask.sum()),
                    num_seqs=int(mini.loss_mask.any(dim=1).sum()),
                    task_ids=self.task_ids[g0:g1],
                    lease_tokens=self.lease_tokens[g0:g1],
                    group_versions=self.group_versions[g0:g1],
                )
            )
        return out

    def _rows(self, rows: slice, cols: slice) -> TrainBatch:
        """The rows ``rows`` and columns ``cols`` of every per-row ([B]) and per-token ([B, T, ...]) field."""

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            return x[rows] if x.dim() == 1 else x[rows, cols]

        return replace(
            self,
            input_ids=cut(self.input_ids),
            attention_mask=cut(self.attention_mask),
            loss_mask=cut(self.loss_mask),
            behaviour_logprobs=cut(self.behaviour_logprobs),
            advantages=cut(self.advantages),
            rewards=cut(self.rewards),
            group_ids=cut(self.group_ids),
            policy_versions=cut(self.policy_versions),
            prompt_lens=cut(self.prompt_lens),
            routed_experts=cut(self.routed_experts),
            ref_logprobs=cut(self.ref_logprobs),
            old_values=cut(self.old_values),
            returns=cut(self.returns),
            proximal_logprobs=cut(self.proximal_logprobs),
        )


def build_train_batch(groups: Sequence[Group], *, pad_id: int, estimator: str = "grpo") -> TrainBatch:
    """Pad the groups' samples into a ``TrainBatch`` and compute group-relative advantages.

    Args:
        groups: the step's groups (at least one).
        pad_id: token id used for right padding (never trained: attention_mask 0, loss_mask False).
        estimator: ``moerl.rl.group_advantages`` estimator: grpo, dr_grpo or rloo; ``gae`` leaves zero
            advantages, which the trainer's critic replaces (``moerl.trainer.critic``).

    Raises:
        ValueError: no groups, or an unknown estimator.
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
        advantages=(
            torch.zeros(num)
            if estimator == "gae"
            else group_advantages(rewards, group_ids, estimator=estimator)
        ),
        rewards=rewards,
        group_ids=group_ids,
        policy_versions=torch.tensor([s.min_policy_version for s in samples], dtype=torch.int64),
        num_tokens=int(loss_mask.sum()),
        num_seqs=int(loss_mask.any(dim=1).sum()),
        task_ids=tuple(g.task_id for g in groups),
        lease_tokens=tuple(g.lease_token for g in groups),
        group_versions=tuple(g.min_policy_version for g in groups),
        prompt_lens=prompt_len,
        routed_experts=routed_experts_batch(samples, length),
    )


def routed_experts_batch(samples: Sequence, length: int) -> torch.Tensor | None:
    """The samples' recorded experts (``Sample.routed_experts`` [P + R - 1, L_moe, k]) right-padded into
    [B, T, L_moe, k] int64 (``TrainBatch.routed_experts`` says what fills the positions never fed).

    Returns:
        None when any sample has no record (routing replay needs every row).

    Raises:
        ValueError: records of different [L_moe, k], or longer than the sample's tokens.
    """
    records = [s.routed_experts for s in samples]
    if not records or any(r is None for r in records):
        return None
    shape = tuple(records[0].shape[1:])
    if any(tuple(r.shape[1:]) != shape for r in records):
        raise ValueError(
            f"routed_experts of one batch have different [L_moe, k]: {[tuple(r.shape) for r in records]}"
        )
    out = torch.arange(shape[1], dtype=torch.int64).expand(len(samples), length, *shape).clone()
    for row, (s, r) in enumerate(zip(samples, records, strict=True)):
        if r.shape[0] > len(s.prompt_ids) + len(s.response_ids):
            raise ValueError(f"routed_experts of row {row} cover {r.shape[0]} tokens; the sample has fewer")
        out[row, : r.shape[0]] = r
    return out
