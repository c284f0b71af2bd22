"""Sampling on device: greedy, temperature, top-k, top-p, with counter-based per-request noise.

Shapes: B rows (sequences being sampled), V vocabulary size.

Reproducibility without per-request ``torch.Generator`` objects: the uniform number that picks the token
of row b is a hash of (request seed, sample index, position of the token in the sequence). A sample is
therefore the same whatever else is in the batch, in whatever slot, at whatever step; the whole batch is
sampled by a few fixed-shape tensor ops, with no host synchronization and no per-row Python loop (so a
decode step can be captured in a CUDA graph). The hash is Wellons' ``lowbias32`` integer mixer
(https://nullprogram.com/blog/2018/07/31/), evaluated in int64 with products kept below 2**63.

The token is drawn by inverse-CDF sampling (one 53-bit uniform per row against the float64 cumulative
distribution of the truncated, renormalized probabilities).

Log-prob convention (the trainer uses the same function, ``token_logprobs``): log softmax(logits / T) of
the sampled token in float32, before top-k/top-p truncation; greedy rows use T = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio, the usual hash-combine increment


def _mulmod32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow (split c into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """Wellons' ``lowbias32`` bijective mixer of 32-bit values (int64 tensors or Python ints).

    Args:
        x: values in [0, 2**32).
    Returns:
        Mixed values in [0, 2**32), same type and shape.
    """
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_salt(v):
    """The mixed second operand of ``hash_combine``: ``hash_combine(h, v) == mix32(h ^ hash_salt(v))``, so
    a constant ``v`` is mixed once on the host (a Python int) rather than per call."""
    return mix32((v + _GOLDEN32) & _M32)


def hash_combine(h, v):
    """Hash of the pair (h, v); ``h`` in [0, 2**32), ``v`` any int (only its low 32 bits are used)."""
    return mix32(h ^ hash_salt(v))


def sample_key(seed: int, sample_index: int) -> int:
    """The 32-bit noise key of one sample of a request: a hash of (seed, sample_index).

    Args:
        seed: any Python int (negative and > 32-bit seeds are hashed on all their low 64 bits).
        sample_index: which of the request's n samples.
    """
    key = hash_combine(mix32(seed & _M32), (seed >> 32) & _M32)
    return hash_combine(key, sample_index)


def uniform_no_sync(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): one per row, a function of (key, position) only.

    Args:
        keys: [B] (or any shape) int64 in [0, 2**32), from ``sample_key``.
        positions: int64 of the same shape, the index in the sequence of the token being sampled.
    Returns:
        float64 of that shape, 53 random bits each (elementwise: the value at (key, position) does not
        depend on the other entries).
    """
    step_key = hash_combine(keys, positions)
    # hash_combine(step_key, 1) and (step_key, 2), mixed together (one mix32's kernels, not two)
    hi, lo = mix32(torch.stack([step_key ^ hash_salt(1), step_key ^ hash_salt(2)])).unbind(0)
    return ((hi >> 11) * (1 << 32) + lo).double() * 2.0**-53  # 21 + 32 bits


@dataclass(kw_only=True, slots=True)
class SamplingRows:
    """Per-row sampling parameters of a batch, as device tensors plus host-side flags.

    The flags are known on the host when the batch is built, so checking them costs no device sync.
    """

    temperature: torch.Tensor
    """[B] float32; 0 marks a greedy row."""
    top_k: torch.Tensor
    """[B] int64; 0 disables top-k for that row."""
    top_p: torch.Tensor
    """[B] float32 in (0, 1]; 1 disables top-p for that row."""
    keys: torch.Tensor
    """[B] int64 noise keys (``sample_key``)."""
    all_greedy: bool = False
    """Every row is greedy: skip the noise and the truncation."""
    any_truncation: bool = True
    """Some row uses top-k or top-p: compute the truncation mask."""


def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens kept by top-k then top-p (on the distribution renormalized after top-k).

    Top-p keeps the most likely tokens until their mass reaches ``top_p`` (the token that crosses it
    included), so at least one token always survives (Holtzman et al. 2020, sec. 3.1).

    Args:
        scaled: [B, V] float32 logits / temperature.
        top_k: [B] int64, 0 = off.
        top_p: [B] float32 in (0, 1], 1 = off.
    Returns:
        [B, V] bool, True = kept.
    """
    vocab = scaled.shape[-1]
    sorted_vals, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    probs = sorted_vals.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """log softmax(logits / T)[token] in float32: the behaviour log-prob convention of moerl.

    The engine and the trainer both call this, so on-policy importance ratios are exactly 1 up to the
    float error of the two forward passes.

    Args:
        logits: [..., V] any float dtype (cast to float32 first).
        tokens: [...] int64 token ids.
        temperature: T > 0, a float or a tensor broadcastable to ``tokens`` (greedy: pass 1).
    Returns:
        [...] float32 log-probs.
    """
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float().unsqueeze(-1)
    scaled = logits.float() / temperature
    return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(dim=-1)


def sample_no_sync(
    logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return it with its behaviour log-prob; no host sync.

    Greedy rows (T = 0) take the argmax of the logits (first index on ties) and report
    log softmax(logits)[token]. Other rows sample from softmax(logits / T) restricted to the top-k/top-p
    set and report log softmax(logits / T)[token] of the untruncated distribution.

    Args:
        logits: [B, V] next-token logits (any float dtype; computed in float32).
        rows: the rows' sampling parameters.
        positions: [B] int64 index in the sequence of the token being sampled (the noise counter).
    Returns:
        tokens [B] int64, logprobs [B] float32.
    """
    greedy = rows.temperature == 0.0
    temp = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    scaled = logits.float() / temp[:, None]
    tokens = scaled.argmax(dim=-1)
    if not rows.all_greedy:
        if rows.any_truncation:
            keep = truncation_mask(scaled, rows.top_k, rows.top_p)
            scaled_kept = scaled.masked_fill(~keep, float("-inf"))
        else:
            scaled_kept = scaled
        cdf = scaled_kept.double().softmax(dim=-1).cumsum(dim=-1)
        u = uniform_no_sync(rows.keys, positions) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
        tokens = torch.where(greedy, tokens, drawn)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(dim=-1)
    return tokens, logprobs
