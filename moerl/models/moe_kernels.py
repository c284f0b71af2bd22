"""Routing-side fast paths of the MoE block on CUDA (Triton): the expert layout (a stable counting sort of
the slots by expert), softmax top-k routing, router logits from bfloat16 operands, and a grouped GEMM for
few rows per expert (decode).

Shape legend: N tokens, H hidden size, E experts, k experts per token (top-k), M = N * k slots ("rows"
once sorted by expert), K / N_out the GEMM's reduction / output widths.

Each function has a tensor-op path (CPU, no Triton, fast paths off) that is its reference;
``bench/gpu_checks.py`` checks the kernels against it on a GPU and ``bench/small_gemm.py`` times the
grouped GEMM against ``torch._grouped_mm``.
"""

from __future__ import annotations

import torch

from moerl.models.fast_paths import _STATE
from moerl.models.fast_paths import use_triton as _use_triton

try:  # optional, as in moerl.models.fast_paths
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def expert_order_no_sync(
    topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the N * k slots by expert without a host sync.

    Args:
        topk_idx: [N, k] int64 expert ids in [0, E).
        num_experts: E.
    Returns:
        order [M] int64 (sorted row m holds slot order[m]; stable, so a token's copies keep their
        order within an expert), inverse [M] int64 (slot s sits at row inverse[s]), and
        offsets [E] int32, the cumulative row ends of the experts (``torch._grouped_mm``'s ``offs``).
    """
    order, inverse, offsets, _, _ = expert_layout(topk_idx, None, num_experts)
    return order, inverse, offsets


def _expert_layout_reference(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, ...]:
    k = topk_idx.shape[-1] if topk_idx.dim() == 2 else 1
    flat = topk_idx.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    rows = torch.arange(flat.numel(), device=flat.device, dtype=order.dtype)
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    token = torch.div(order, k, rounding_mode="floor")
    row_w = None if topk_weights is None else topk_weights.reshape(-1).float().index_select(0, order)
    return order, inverse, offsets, token, row_w


if triton is not None:

    @triton.jit
    def _expert_hist_kernel(ids_ptr, hist_ptr, M, C, E: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
        # hist[e, c] = slots of chunk c (BLOCK slots) routed to expert e.
        c = tl.program_id(0)
        m = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + m, mask=m < M, other=-1)
        e = tl.arange(0, EP)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        tl.store(hist_ptr + e * C + c, tl.sum(onehot, axis=0), mask=e < E)

    @triton.jit
    def _expert_place_kernel(
        ids_ptr,
        w_ptr,
        cum_ptr,
        hist_ptr,
        order_ptr,
        inv_ptr,
        token_ptr,
        roww_ptr,
        offs_ptr,
        M,
        C,
        K: tl.constexpr,
        E: tl.constexpr,
        EP: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_W: tl.constexpr,
    ):
        # Row of slot m = (slots of lower experts) + (slots of its expert in earlier chunks) + (its
        # rank among the chunk's slots of that expert): a stable counting sort.
        c = tl.program_id(0)
        m = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mm = m < M
        ids = tl.load(ids_ptr + m, mask=mm, other=-1)
        e = tl.arange(0, EP)
        em = e < E
        hit = ids[:, None] == e[None, :]
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        base = tl.load(cum_ptr + e * C + c, mask=em, other=0) - tl.load(
            hist_ptr + e * C + c, mask=em, other=0
        )
        pos = tl.sum(tl.where(hit, base[None, :] + rank, 0), axis=1).to(tl.int64)
        tl.store(inv_ptr + m, pos, mask=mm)
        tl.store(order_ptr + pos, m, mask=mm)
        tl.store(token_ptr + pos, m // K, mask=mm)
        if HAS_W:
            tl.store(roww_ptr + pos, tl.load(w_ptr + m, mask=mm, other=0.0).to(tl.float32), mask=mm)
        if c == 0:
            tl.store(offs_ptr + e, tl.load(cum_ptr + e * C + C - 1, mask=em, other=0).to(tl.int32), mask=em)


def expert_layout(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stable counting sort of the N * k slots by expert, no host sync: (order, inverse, offsets) as
    ``expert_order_no_sync``, plus token [M] int64 (= order // k) and the combine weight of each sorted
    row [M] float32 (None without ``topk_weights``).

    On CUDA three launches (per-chunk expert histograms, one cumulative sum, one placement kernel)
    instead of a radix sort and five small kernels; elsewhere ``torch.sort`` and tensor ops.
    """
    if not (_use_triton(topk_idx) and topk_idx.numel()):
        return _expert_layout_reference(topk_idx, topk_weights, num_experts)
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    m, dev = flat.numel(), flat.device
    ep = triton.next_power_of_2(num_experts)
    block = max(16, min(256, 8192 // ep))
    chunks = triton.cdiv(m, block)
    hist = torch.empty(num_experts * chunks, dtype=torch.int32, device=dev)
    _expert_hist_kernel[(chunks,)](flat, hist, m, chunks, E=num_experts, EP=ep, BLOCK=block)
    cum = hist.cumsum(0)  # int64, expert-major then chunk
    order = torch.empty(m, dtype=torch.int64, device=dev)
    inverse, token = torch.empty_like(order), torch.empty_like(order)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=dev)
    has_w = topk_weights is not None
    row_w = torch.empty(m, dtype=torch.float32, device=dev) if has_w else None
    w = topk_weights.reshape(-1).contiguous() if has_w else flat
    _expert_place_kernel[(chunks,)](
        flat, w, cum, hist, order, inverse, token, row_w if has_w else order, offsets, m, chunks,
        K=k, E=num_experts, EP=ep, BLOCK=block, HAS_W=has_w,
    )  # fmt: skip
    return order, inverse, offsets, token, row_w


# ----------------------------------------------------------------------------------------------
# Routing: softmax, top-k and renormalization of router logits in one kernel (inference)

if triton is not None:

    @triton.jit
    def _route_kernel(
        logits_ptr,
        idx_ptr,
        w_ptr,
        N,
        E: tl.constexpr,
        EP: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # Rows of BLOCK_N tokens: p = softmax(logits); k rounds of argmax (the first index among equal
        # scores), each removing the chosen expert; weights p[chosen], divided by their sum with NORM.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = rows < N
        e = tl.arange(0, EP)
        em = e < E
        z = tl.load(
            logits_ptr + rows[:, None] * E + e[None, :], mask=rm[:, None] & em[None, :], other=float("-inf")
        )
        z = tl.where(rm[:, None], z, 0.0)
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = tl.where(em[None, :], p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        sel = tl.where(em[None, :], p, -1.0)
        j = tl.arange(0, KP)
        chosen = tl.zeros([BLOCK_N, KP], dtype=tl.int64)
        vals = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r in tl.static_range(K):
            best = tl.argmax(sel, axis=1)
            val = tl.max(sel, axis=1)
            chosen = tl.where(j[None, :] == r, best.to(tl.int64)[:, None], chosen)
            vals = tl.where(j[None, :] == r, val[:, None], vals)
            total += val
            sel = tl.where(e[None, :] == best[:, None], -1.0, sel)
        if NORM:
            vals = vals / total[:, None]
        out = rows[:, None] * K + j[None, :]
        om = rm[:, None] & (j[None, :] < K)
        tl.store(idx_ptr + out, chosen, mask=om)
        tl.store(w_ptr + out, vals, mask=om)


def fused_route_supported(logits: torch.Tensor, top_k: int) -> bool:
    """Whether ``fused_route`` serves a softmax routing of these logits: fast paths on, Triton, CUDA
    float32 logits [N, E] with E <= 1024, k <= E, and no gradient needed (inference: the rollout's
    prefill and decode; training keeps the differentiable tensor ops)."""
    return (
        _use_triton(logits)
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.shape[1] <= 1024
        and 0 < top_k <= logits.shape[1]
        and not (torch.is_grad_enabled() and logits.requires_grad)
    )


def fused_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing of router logits [N, E] float32 in one Triton kernel (Shazeer et al. 2017):
    scores = softmax(logits), the k best experts in descending score order, their scores as weights,
    divided by their sum when ``norm_topk_prob``. Returns (topk_idx [N, k] int64, weights [N, k] float32),
    the values of ``moerl.models.moe.route``'s tensor ops up to float32 rounding (a near-tie may pick
    the other expert). No autograd: use ``fused_route_supported`` first."""
    n, e = logits.shape
    idx = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    if n:
        ep = triton.next_power_of_2(e)
        block_n = max(1, min(64, 4096 // ep))
        _route_kernel[(triton.cdiv(n, block_n),)](
            logits.contiguous(), idx, w, n, E=e, EP=ep, K=top_k, KP=triton.next_power_of_2(top_k),
            NORM=norm_topk_prob, BLOCK_N=block_n,
        )  # fmt: skip
    return idx, w


_MM_OUT_DTYPE = {"ok": hasattr(torch, "mm")}


def router_logits_from_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """Router logits x @ weight^T [N, E] float32 from bfloat16 x [N, H] and weight [E, H] in one GEMM with
    float32 output (``torch.mm(..., out_dtype=torch.float32)``: bf16 products are exact in float32 and
    the sums run in float32, so this equals ``F.linear(x.float(), weight.float())`` up to summation
    order) instead of two casts and a float32 GEMM. Inference only (no gradient needed), CUDA, fast
    paths on; returns None where it does not apply (the caller then runs the float32 GEMM)."""
    if not (
        _STATE["enabled"]
        and _MM_OUT_DTYPE["ok"]
        and x.is_cuda
        and x.dim() == 2
        and x.dtype == weight.dtype == torch.bfloat16
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return None
    try:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):  # an older torch without mm's out_dtype
        _MM_OUT_DTYPE["ok"] = False
        return None


# ----------------------------------------------------------------------------------------------
# Grouped GEMM for few rows per expert (decode): weight-streaming Triton kernel

if triton is not None:

    @triton.jit
    def _small_grouped_mm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        offs_ptr,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program (n tile, expert e): out[rows of e, n tile] = x[rows of e] @ w[e, n tile, :]^T, float32
        # accumulation; the weight tile streams from memory once per BLOCK_M rows of the expert.
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        end = tl.load(offs_ptr + e).to(tl.int64)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        kk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e.to(tl.int64) * N * K + n[:, None].to(tl.int64) * K
        for m0 in range(start, end, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            mm = m < end
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                km = (k0 + kk) < K
                a = tl.load(
                    x_ptr + m[:, None] * K + (k0 + kk)[None, :], mask=mm[:, None] & km[None, :], other=0.0
                )
                b = tl.load(w_base + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc)
            tl.store(
                out_ptr + m[:, None] * N + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=mm[:, None] & nm[None, :],
            )


SMALL_GROUPED_MM = {
    "max_rows_per_expert": 48,
    "block_m": 64,
    "block_n": 128,
    "block_k": 64,
    "stages": 4,
    "warps": 4,
}
"""Configuration of ``small_grouped_mm`` and the largest mean number of rows per expert for which
``fused_experts`` uses it (0 turns it off). Chosen from bench/small_gemm.py on an H200 (E = 64, H = 2048,
I = 1024): at 16-32 rows per expert 0.86-0.94 of the copy bandwidth where ``torch._grouped_mm`` reaches
0.59-0.68; at 64 rows per expert the two are even, so larger batches keep ``torch._grouped_mm``."""


def small_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``fused_experts`` should use ``small_grouped_mm`` for x [M, K] @ w[e]^T: fast paths on,
    CUDA bfloat16, no gradient needed, at most ``SMALL_GROUPED_MM["max_rows_per_expert"]`` rows per expert
    on average (decode batches; larger batches use ``torch._grouped_mm``)."""
    limit = SMALL_GROUPED_MM["max_rows_per_expert"]
    return (
        _use_triton(x)
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[0] <= limit * w.shape[0]
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def small_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, **config) -> torch.Tensor:
    """out[m] = x[m] @ w[e(m)]^T for expert-sorted rows: x [M, K], w [E, N, K] (contiguous), offsets [E]
    int32 cumulative row ends -> [M, N] in x's dtype; ``torch._grouped_mm(x, w.transpose(-2, -1),
    offs=offsets)`` up to float32 summation order. No autograd. ``config`` overrides
    ``SMALL_GROUPED_MM`` (block_m, block_n, block_k, stages, warps)."""
    cfg = {**SMALL_GROUPED_MM, **config}
    m, k = x.shape
    e, n, _ = w.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _small_grouped_mm_kernel[(triton.cdiv(n, cfg["block_n"]), e)](
            x.contiguous(), w.contiguous(), out, offsets, n, k,
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_stages=cfg["stages"], num_warps=cfg["warps"],
        )  # fmt: skip
    return out
