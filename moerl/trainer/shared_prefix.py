"""Shared-prompt training forward: each group's prompt runs once, not once per sample.

The n samples of a GRPO group share one prompt of P tokens. An unshared forward runs n copies of it,
and since the decoder is causal every copy has the same hidden states, keys and values. Here the first
P - 1 prompt tokens run once per group (the *prefix* pass, which keeps each layer's keys and values),
then each sample's last prompt token and response run as its *suffix*, whose queries attend to their
group's prefix keys/values and causally to the suffix itself. Gradients reach the prefix through those
keys and values (autograd sums them over the group's samples). Log-probs equal the unshared forward's
up to float rounding. This is the shared-prefix forward of Prefix Grouper (Liu et al. 2025,
arXiv:2506.05433, sec. 3), here through the model's KV-cache seam (``moerl.models.layers.KVCache``).

The last prompt token stays in the suffix because its logits predict the first response token, and
the suffix pass is the one whose logits are kept. The two passes are two forwards: under expert
parallelism (``moerl.ep``) each runs its own dispatch/combine, so every EP rank must take the same path.

Shapes: B rows (samples) of the micro-batch, T its padded length, G groups in it, Pp the longest prefix
(prompt length - 1), S the longest suffix (1 + response length), V vocabulary, L_moe MoE layers, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.models.model import causal_padding_mask, positions_from_mask


@dataclass(frozen=True, slots=True)
class PrefixSplit:
    """A right-padded micro-batch cut into per-group prefixes and per-sample suffixes."""

    prefix_ids: torch.Tensor
    """[G, Pp] int64: the first P_g - 1 prompt tokens of each group, right-padded."""
    prefix_mask: torch.Tensor
    """[G, Pp] int64: 1 at prefix tokens, 0 at padding."""
    suffix_ids: torch.Tensor
    """[B, S] int64: each sample's last prompt token, then its response, right-padded."""
    suffix_mask: torch.Tensor
    """[B, S] int64: 1 at suffix tokens, 0 at padding."""
    columns: torch.Tensor
    """[B, S] int64: column of each suffix token in the [B, T] batch, P_b - 1 + j (0 at padding). Rows
    are right-padded, so this is also the token's position id."""
    row_group: torch.Tensor
    """[B] int64: each row's group, an index into the G prefixes."""

    @property
    def valid(self) -> torch.Tensor:
        """[B, S] bool: real suffix tokens."""
        return self.suffix_mask.bool()

    def to_suffix(self, x: torch.Tensor, fill) -> torch.Tensor:
        """[B, T] -> [B, S]: the values at the suffix tokens' columns, ``fill`` at padding."""
        return torch.where(self.valid, x.gather(1, self.columns), fill)

    def to_batch(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """[B, S, ...] -> [B, T, ...]: suffix values placed at their columns, 0 elsewhere (differentiable)."""
        rows, j = self.valid.nonzero(as_tuple=True)
        out = x.new_zeros((x.shape[0], length, *x.shape[2:]))
        return out.index_put((rows, self.columns[rows, j]), x[rows, j])


def split_shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor, group_ids: torch.Tensor
) -> PrefixSplit | None:
    """Cut a right-padded batch into its groups' shared prefixes and the samples' suffixes.

    Args:
        input_ids: [B, T] int64, prompt then response then padding in each row.
        attention_mask: [B, T], 1 at real tokens.
        prompt_lens: [B] int64, prompt tokens of each row (>= 1).
        group_ids: [B] int64, the row's group; a group's rows are consecutive.

    Returns:
        The split, or None when no prompt is longer than one token (nothing to share).

    Raises:
        ValueError: bad shapes, a prompt length < 1 or beyond the row, or rows of one group whose
            prompts differ (their length or tokens).
    """
    b, t = input_ids.shape
    if attention_mask.shape != (b, t) or prompt_lens.shape != (b,) or group_ids.shape != (b,):
        raise ValueError(
            f"split_shared_prefix: input_ids {tuple(input_ids.shape)}, attention_mask "
            f"{tuple(attention_mask.shape)}, prompt_lens {tuple(prompt_lens.shape)} and group_ids "
            f"{tuple(group_ids.shape)} do not fit [B, T], [B, T], [B], [B]"
        )
    seq_len = attention_mask.sum(dim=1)
    if bool((prompt_lens < 1).any() | (prompt_lens > seq_len).any()):
        raise ValueError("split_shared_prefix: every prompt length must be in [1, the row's token count]")
    _, row_group, counts = torch.unique_consecutive(group_ids, return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts  # (G,) first row of each group
    prefix_len = prompt_lens[first] - 1  # (G,)
    width = int(prefix_len.max())
    if width == 0:
        return None
    cols = torch.arange(width, device=input_ids.device)
    prefix_mask = cols < prefix_len[:, None]  # (G, Pp)
    prefix_ids = torch.where(prefix_mask, input_ids[first, :width], 0)
    same = (input_ids[:, :width] == prefix_ids[row_group]) | ~prefix_mask[row_group]
    if bool((prompt_lens != prompt_lens[first][row_group]).any()) or not bool(same.all()):
        raise ValueError("split_shared_prefix: the rows of a group must share one prompt (length and tokens)")
    suffix_len = seq_len - prompt_lens + 1  # (B,) last prompt token + response
    j = torch.arange(int(suffix_len.max()), device=input_ids.device)
    valid = j < suffix_len[:, None]  # (B, S)
    columns = torch.where(valid, prompt_lens[:, None] - 1 + j, 0)
    return PrefixSplit(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask.long(),
        suffix_ids=torch.where(valid, input_ids.gather(1, columns), 0),
        suffix_mask=valid.long(),
        columns=columns,
        row_group=row_group,
    )


class _PrefixCapture:
    """KV-cache seam of the prefix pass: causal attention over the prefix, keys/values kept per layer."""

    def __init__(self, prefix_mask: torch.Tensor) -> None:
        self.attn_mask = causal_padding_mask(prefix_mask)  # (G, 1, Pp, Pp)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv[layer_idx] = (k, v)
        return k, v


class _SharedPrefixCache:
    """KV-cache seam of the suffix pass: each row's keys/values are its group's prefix, then its suffix."""

    def __init__(self, prefix_kv: dict, split: PrefixSplit) -> None:
        self.prefix_kv, self.row_group = prefix_kv, split.row_group
        s = split.suffix_ids.shape[1]
        sees_prefix = split.prefix_mask.bool()[split.row_group][:, None, None, :]  # (B, 1, 1, Pp)
        self.attn_mask = torch.cat(  # (B, 1, S, Pp + S)
            [sees_prefix.expand(-1, 1, s, -1), causal_padding_mask(split.suffix_mask)], dim=-1
        )

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pk, pv = self.prefix_kv[layer_idx]
        return torch.cat([pk[self.row_group], k], dim=2), torch.cat([pv[self.row_group], v], dim=2)


@dataclass(frozen=True, slots=True)
class SharedForward:
    """Output of ``shared_prefix_forward``."""

    logits: torch.Tensor
    """[B, S, V] suffix logits: position j predicts suffix token j + 1 (aligned with ``PrefixSplit``)."""
    aux_loss: torch.Tensor
    """scalar float32: the two passes' load-balancing losses weighted by the tokens each stands for
    (a prefix token counts once per sample of its group). Close to, not equal to, the unshared value:
    the loss is not additive over token sets."""
    routed_experts: torch.Tensor | None
    """[B, T, L_moe, k] int64 chosen experts at every real token, as the unshared forward returns them
    (the prefix's choices copied to each sample of its group); None unless asked for."""


def shared_prefix_forward(
    model: torch.nn.Module,
    split: PrefixSplit,
    length: int,
    *,
    return_routed_experts: bool = False,
    forced_experts: torch.Tensor | None = None,
) -> SharedForward:
    """Run ``model`` (a ``MoeForCausalLM``) on ``split``: the prefix pass, then the suffix pass.

    Args:
        model: the policy; its attention must go through the ``KVCache`` seam.
        split: from ``split_shared_prefix``.
        length: T, the batch's padded length (for ``routed_experts``).
        return_routed_experts: also return the routed experts in batch layout.
        forced_experts: [B, T, L_moe, k] int64 experts to replay (R3) in batch layout; the prefix pass
            takes a group's prompt experts from its rows (the engine prefills a group's prompt once, so
            they are equal), the suffix pass each row's own.
    """
    pre_forced = suf_forced = None
    if forced_experts is not None:
        width = split.prefix_ids.shape[1]
        pre_forced = forced_experts.new_zeros(split.prefix_ids.shape[0], width, *forced_experts.shape[2:])
        pre_forced[split.row_group] = forced_experts[:, :width]  # rows of one group agree
        rows = torch.arange(split.columns.shape[0], device=split.columns.device)[:, None]
        suf_forced = forced_experts[rows, split.columns]  # (B, S, L_moe, k)
    capture = _PrefixCapture(split.prefix_mask)
    pre = model(
        split.prefix_ids,
        split.prefix_mask,
        positions_from_mask(split.prefix_mask),
        cache=capture,
        forced_experts=pre_forced,
        return_routed_experts=return_routed_experts,
    )
    suf = model(
        split.suffix_ids,
        split.suffix_mask,
        split.columns,  # position ids
        cache=_SharedPrefixCache(capture.kv, split),
        forced_experts=suf_forced,
        return_routed_experts=return_routed_experts,
    )
    prefix_tokens = split.prefix_mask[split.row_group].sum()  # each sample's copy of its prefix
    suffix_tokens = split.suffix_mask.sum()
    aux = (prefix_tokens * pre.aux_loss + suffix_tokens * suf.aux_loss) / (prefix_tokens + suffix_tokens)
    routed = None
    if return_routed_experts:
        routed = split.to_batch(suf.routed_experts, length)  # (B, T, L_moe, k)
        width = split.prefix_ids.shape[1]
        own_prefix = split.prefix_mask.bool()[split.row_group]  # (B, Pp)
        routed[:, :width][own_prefix] = pre.routed_experts[split.row_group][own_prefix]
    return SharedForward(logits=suf.logits, aux_loss=aux, routed_experts=routed)
