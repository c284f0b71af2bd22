"""Loss aggregation: reduce per-token values [B, T] under a mask to the scalar that is optimized.

Normalizers are global to the optimizer step. A step whose batch is split into k micro-batches
calls ``aggregate`` once per micro-batch with the step's total ``num_tokens`` / ``num_seqs``; the
micro-batch losses then add up (and their gradients accumulate) to exactly the loss of the whole
batch, because every mode below is a sum over tokens or sequences divided by a step-wide constant.
Taking the normalizer per micro-batch instead weights a token by the size of its micro-batch.

Modes (m = mask, L_b = sum_t m_bt is the length of sequence b, G = num_seqs, N = num_tokens):

- ``token-mean``:              sum_bt m v / N  (DAPO, Yu et al. 2025, eq. 8: 1 / sum_i |o_i|)
- ``seq-mean-token-mean``:     sum_b (sum_t m v / L_b) / G  (GRPO, Shao et al. 2024, eq. 3)
- ``seq-mean-token-sum``:      sum_b (sum_t m v) / G
- ``seq-mean-token-sum-norm``: sum_bt m v / (G * norm_length)  (Dr. GRPO, Liu et al. 2025, Sec. 3.1:
  a constant length, usually the generation budget, replaces 1 / |o_i|)
"""

from __future__ import annotations

import torch

from moerl.rl._checks import as_mask, check_ndim, check_same_shape

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The aggregation modes that ``aggregate`` accepts."""


def _positive(name: str, value: float | int) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0")
    return value


def _token_mean(masked, lengths, num_tokens, num_seqs, norm_length):
    return masked.sum() / num_tokens


def _seq_mean_token_mean(masked, lengths, num_tokens, num_seqs, norm_length):
    return (masked.sum(dim=1) / lengths.clamp_min(1)).sum() / num_seqs


def _seq_mean_token_sum(masked, lengths, num_tokens, num_seqs, norm_length):
    return masked.sum() / num_seqs


def _seq_mean_token_sum_norm(masked, lengths, num_tokens, num_seqs, norm_length):
    return masked.sum() / (num_seqs * norm_length)


_AGGREGATORS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
assert tuple(_AGGREGATORS) == AGGREGATION_MODES


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | int | None = None,
    num_seqs: float | int | None = None,
    norm_length: float | int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` over the positions where ``mask`` is set, with global normalizers.

    Masked-out positions are excluded with ``torch.where``, so a NaN or inf there never reaches the
    result or its gradient.

    Args:
        values: per-token values [B, T], float (e.g. per-token losses).
        mask: [B, T], bool or 0/1; True where the token counts.
        mode: one of ``AGGREGATION_MODES`` (formulas and sources in the module docstring).
        num_tokens: the optimizer step's total count of masked-in tokens over all micro-batches
            (``token-mean``); ``None``: this batch's ``mask.sum()``.
        num_seqs: the optimizer step's total count of sequences (``seq-mean-*``); ``None``: the rows of
            this batch with at least one masked-in token.
        norm_length: the constant length of ``seq-mean-token-sum-norm`` in tokens (Dr. GRPO uses the
            generation budget, max new tokens); ``None``: ``T``. Pass the same value to every
            micro-batch of a step.

    Returns:
        A 0-dim tensor of ``values``' dtype. A batch with no masked-in token gives 0 (with gradient).

    Raises:
        ValueError: unknown mode, shapes that are not the same [B, T], or a normalizer <= 0.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode={mode!r} is not an aggregation mode; choose one of {list(AGGREGATION_MODES)}")
    check_ndim("values", values, 2, "[B, T]")
    check_same_shape(values=values, mask=mask)
    mask = as_mask("mask", mask)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    lengths = mask.sum(dim=1)  # (B,)
    # Defaults are this batch's counts (clamped so that an empty batch gives 0, not NaN).
    tokens = _positive("num_tokens", num_tokens) if num_tokens is not None else lengths.sum().clamp_min(1)
    seqs = _positive("num_seqs", num_seqs) if num_seqs is not None else (lengths > 0).sum().clamp_min(1)
    length = _positive("norm_length", norm_length) if norm_length is not None else values.shape[1]
    return _AGGREGATORS[mode](masked, lengths, tokens, seqs, length)
