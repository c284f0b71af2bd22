"""How far a lower-precision rollout policy (``rollout.weight_dtype=fp8``) is from the policy it stands for.

Both models are run teacher-forced over the same sequences (prompt + response); at every response
position t (the logits that predict response token y_t):

- log-prob gap: |log p_cand(y_t | y_<t) - log p_ref(y_t | y_<t)| (log-softmax of the raw logits, T = 1);
- greedy agreement: argmax p_cand(. | y_<t) == argmax p_ref(. | y_<t).

Shapes: B sequences, T padded length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LogprobGap:
    """Gap statistics over the response tokens of a batch."""

    logprob_gap_mean: float
    """Mean |log p_cand - log p_ref| of the response tokens, nats."""
    logprob_gap_max: float
    """Largest such gap, nats."""
    greedy_agreement: float
    """Fraction of response positions where the two argmax tokens agree, in [0, 1]."""
    tokens: int
    """Response tokens compared."""


def _padded(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], device) -> tuple[torch.Tensor, ...]:
    """ids [B, T] right-padded with 0, attention mask [B, T], response mask [B, T] (True where the
    logits at t-1 predict a response token t: marked at t - 1)."""
    lengths = [len(p) + len(r) for p, r in sequences]
    t = max(lengths)
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    attn = torch.zeros(len(sequences), t, dtype=torch.long)
    pred = torch.zeros(len(sequences), t, dtype=torch.bool)
    for i, (p, r) in enumerate(sequences):
        ids[i, : lengths[i]] = torch.tensor([*p, *r], dtype=torch.long)
        attn[i, : lengths[i]] = 1
        pred[i, len(p) - 1 : lengths[i] - 1] = True
    return ids.to(device), attn.to(device), pred.to(device)


@torch.no_grad()
def logprob_gap(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> LogprobGap:
    """Log-prob gap and greedy agreement of ``candidate`` against ``reference`` (module docstring).

    Args:
        reference, candidate: ``moerl.models`` causal LMs over the same vocabulary (e.g. the bf16 policy
            and the engine's FP8 copy), on the same device.
        sequences: (prompt ids, response ids) pairs; prompts non-empty.
    Returns:
        ``LogprobGap``; NaN figures and 0 tokens when no sequence has a response token.
    Raises:
        ValueError: no sequences, or an empty prompt.
    """
    if not sequences or any(len(p) == 0 for p, _ in sequences):
        raise ValueError("logprob_gap needs at least one sequence, each with a non-empty prompt")
    device = next(reference.parameters()).device
    ids, attn, pred = _padded(sequences, device)
    if not pred.any():
        return LogprobGap(float("nan"), float("nan"), float("nan"), 0)
    target = ids.roll(-1, dims=1)  # [B, T]: the token each position predicts
    ref = torch.log_softmax(reference(ids, attn).logits.float(), dim=-1)  # [B, T, V]
    cand = torch.log_softmax(candidate(ids, attn).logits.float(), dim=-1)
    gap = (cand.gather(-1, target[..., None]) - ref.gather(-1, target[..., None])).squeeze(-1).abs()[pred]
    agree = (cand.argmax(-1) == ref.argmax(-1))[pred]
    return LogprobGap(
        logprob_gap_mean=gap.mean().item(),
        logprob_gap_max=gap.max().item(),
        greedy_agreement=agree.float().mean().item(),
        tokens=int(pred.sum()),
    )
