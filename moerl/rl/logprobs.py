"""Per-token log-probs and entropies from a causal LM's logits, aligned with the labels.

Alignment convention (Hugging Face causal-LM labels): ``labels`` [B, T] are the input ids with
``ignore_index`` at positions that are not trained (prompt, padding). The logits at position t
predict the token at t + 1, so the value returned at position t describes ``labels[:, t]`` and is
computed from ``logits[:, t - 1]``; position 0 (predicted by nothing) and ignored positions hold 0.
The outputs are therefore aligned with ``input_ids``, the loss mask ``labels != ignore_index`` and
the rollout engine's per-token behaviour log-probs.

Temperature convention (the rollout engine's): a behaviour log-prob is
``log softmax(logits / temperature)`` of the sampled token, before any top-k / top-p truncation;
greedy decoding reports temperature 1. Pass the rollout temperature to ``token_logprobs`` so that
trainer and engine log-probs agree.

Memory: both functions work on chunks of positions in float32 and recompute each chunk in the
backward pass (a custom autograd function with the analytic gradients), so no float32 copy of the
whole [B, T, V] logits is kept alive; the only full-size tensor is the logits' own gradient.
Only the positions that predict a trained label are computed (gathered rows of the logits).
"""

from __future__ import annotations

import torch

from moerl.rl._checks import check_ndim


def _selected_logprob(z: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z)[index] and its gradient direction d/dz = onehot(index) - softmax(z)."""
    logp = torch.log_softmax(z, dim=-1)
    grad = -logp.exp()
    grad.scatter_add_(-1, index.unsqueeze(-1), torch.ones_like(grad[..., :1]))
    return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1), grad


def _entropy(z: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H(softmax(z)) = -sum p log p and its gradient d/dz_j = -p_j (log p_j + H)."""
    del index  # same signature as _selected_logprob
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(dim=-1)
    return entropy, -p * (logp + entropy.unsqueeze(-1))


_KINDS = {"logprob": _selected_logprob, "entropy": _entropy}


class _ChunkedPerPosition(torch.autograd.Function):
    """Per-position value of ``logits / temperature``, computed in float32 (float64 logits: float64) chunks.

    Backward recomputes each chunk instead of saving float32 softmax tensors, so the memory held
    for backward is the logits themselves (which the model output keeps alive anyway).
    """

    @staticmethod
    def forward(ctx, logits, index, kind: str, temperature: float, step: int):
        fn = _KINDS[kind]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(index.shape, dtype=compute_dtype, device=logits.device)
        for t0 in range(0, index.shape[1], step):
            z = logits[:, t0 : t0 + step].to(compute_dtype) / temperature
            out[:, t0 : t0 + step] = fn(z, index[:, t0 : t0 + step])[0]
        ctx.save_for_backward(logits, index)
        ctx.kind, ctx.temperature, ctx.step = kind, temperature, step
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, index = ctx.saved_tensors
        fn, step = _KINDS[ctx.kind], ctx.step
        grad = torch.empty_like(logits)
        for t0 in range(0, index.shape[1], step):
            z = logits[:, t0 : t0 + step].to(grad_out.dtype) / ctx.temperature
            direction = fn(z, index[:, t0 : t0 + step])[1]
            chunk_grad = grad_out[:, t0 : t0 + step].unsqueeze(-1) * direction / ctx.temperature
            grad[:, t0 : t0 + step] = chunk_grad.to(grad.dtype)
        return grad, None, None, None, None


def _per_position(
    kind: str,
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    temperature: float,
    chunk_tokens: int,
) -> torch.Tensor:
    """``kind`` of ``logits[:, t - 1] / temperature`` for ``labels[:, t]``, as [B, T] float32 (float64
    for float64 logits)."""
    check_ndim("logits", logits, 3, "[B, T, V]")
    check_ndim("labels", labels, 2, "[B, T]")
    batch, seq_len, vocab = logits.shape
    if tuple(labels.shape) != (batch, seq_len):
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy log-probs use temperature 1)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    target = labels[:, 1:]
    valid = target != ignore_index
    out_of_vocab = valid & ((target < 0) | (target >= vocab))
    if bool(out_of_vocab.any()):
        bad = int(target[out_of_vocab][0])
        raise ValueError(f"labels contain id {bad} outside the vocabulary [0, {vocab}) and != ignore_index")
    # Only the trained positions are computed: the logits row b*T + t - 1 predicts labels[b, t], for
    # valid (b, t); the last position predicts nothing. index_select's backward scatters the gradient
    # into a [B*T, V] tensor, the same size as the logits' gradient of a full pass.
    b_idx, t_idx = valid.nonzero(as_tuple=True)  # t_idx indexes target, i.e. label position t_idx + 1
    rows = b_idx * seq_len + t_idx  # (N,) logits rows
    picked = logits.reshape(batch * seq_len, vocab).index_select(0, rows)  # (N, V)
    index = target[b_idx, t_idx]  # (N,)
    values = _ChunkedPerPosition.apply(picked[None], index[None], kind, float(temperature), chunk_tokens)[0]
    out = torch.zeros(batch * seq_len, dtype=values.dtype, device=logits.device)
    return out.index_copy(0, rows + 1, values).view(batch, seq_len)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-prob of each label token under ``softmax(logits / temperature)``, aligned with the labels.

    ``out[b, t] = log_softmax(logits[b, t - 1] / temperature)[labels[b, t]]`` in float32, computed
    with log_softmax + gather (see the module docstring for the alignment and temperature conventions).

    Args:
        logits: [B, T, V] model output, any float dtype; gradients flow through it.
        labels: [B, T] int64 input ids, ``ignore_index`` where not trained.
        temperature: the rollout sampling temperature, > 0 (greedy: 1.0).
        ignore_index: label value of positions to skip.
        chunk_tokens: positions (B x chunk length) processed at once; bounds the float32 working memory.

    Returns:
        [B, T] float32 log-probs (<= 0; float64 for float64 logits); 0 at position 0 and at ignored
        positions.

    Raises:
        ValueError: bad shapes, temperature <= 0, or a label outside ``[0, V)`` that is not ignored.
    """
    return _per_position("logprob", logits, labels, ignore_index, temperature, chunk_tokens)


def entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Entropy of the next-token distribution at the positions that predict the trained labels.

    ``out[b, t] = H(softmax(logits[b, t - 1] / temperature))`` with ``H(p) = -sum_v p_v log p_v``
    (Shannon entropy, nats), aligned with ``labels`` as ``token_logprobs`` is; the mean of ``out``
    over ``labels != ignore_index`` is the policy's mean token entropy.

    Args:
        logits: [B, T, V] model output, any float dtype; gradients flow (for an entropy bonus).
        labels: [B, T] int64 input ids, ``ignore_index`` where not trained.
        ignore_index: label value of positions to skip.
        temperature: temperature of the distribution, > 0.
        chunk_tokens: positions processed at once.

    Returns:
        [B, T] float32 entropies in nats (float64 for float64 logits), in [0, log V]; 0 at position 0
        and at ignored positions.

    Raises:
        ValueError: bad shapes, temperature <= 0, or a label outside ``[0, V)`` that is not ignored.
    """
    return _per_position("entropy", logits, labels, ignore_index, temperature, chunk_tokens)
