"""Fast paths of the MoE experts on CUDA: sync-free permutation, SwiGLU and weighted combine (Triton).

Shape legend: N tokens, H hidden size, E experts, k experts per token (top-k), I expert intermediate
size, M = N * k expert-sorted token copies ("rows"); a "slot" is one (token, choice) pair, flat index
n * k + j.

``fused_experts`` computes the function of ``moerl.models.moe.Experts.forward``,
y_n = sum_j w_nj * down_e(silu(g) * u) with [g, u] = gate_up_e x_n and e = topk_idx[n, j]
(SwiGLU experts, Shazeer 2020 Eq. 5; top-k combine, Shazeer et al. 2017 Eq. 1), in a form that

- never waits for the device: the per-expert row offsets come from a sort and a ``searchsorted`` over
  the sorted expert ids instead of ``torch.bincount`` (whose CUDA kernel reads the input's maximum on
  the host), so a decode step that uses it can be captured in a CUDA graph;
- runs both expert projections as one grouped GEMM each (``torch._grouped_mm``);
- applies the combine weights inside the SwiGLU kernel (w * silu(g) * u, before the down projection,
  which is linear) and sums the k expert outputs of each token in one Triton kernel that gathers the
  k rows in float32 and writes the token once (no [M, H] weighting pass, no bfloat16 atomics); the
  backward of that sum is a row gather, the weight gradients are row dot products in the SwiGLU
  backward kernel, and the permutation's backward is the same gather-and-sum, so the backward has no
  atomics and is deterministic.

The attention-side kernels (RMSNorm, rotary embedding) are in ``moerl.models.layer_kernels``; the
switch ``fast_paths`` here covers both.

Without Triton (or on CPU) the same functions run as plain tensor ops, which is also the reference the
unit tests compare the kernels against. ``fast_paths(False)`` turns the fast paths off (for agreement
checks against the reference path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

try:  # Triton is optional: CPU installs and CUDA machines without it use the tensor-op fallbacks.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

_STATE = {"enabled": True}


def set_fast_paths(enabled: bool) -> bool:
    """Turn the fast paths on or off process-wide; returns the previous setting."""
    prev = _STATE["enabled"]
    _STATE["enabled"] = bool(enabled)
    return prev


@contextlib.contextmanager
def fast_paths(enabled: bool) -> Iterator[None]:
    """Context manager form of ``set_fast_paths`` (restores the previous setting on exit)."""
    prev = set_fast_paths(enabled)
    try:
        yield
    finally:
        set_fast_paths(prev)


def fast_paths_enabled() -> bool:
    """Whether the fast paths are on (the default)."""
    return _STATE["enabled"]


def fused_experts_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``fused_experts`` should serve this call: fast paths on, a CUDA bfloat16 input,
    ``torch._grouped_mm`` present and every row stride 16-byte aligned (its requirement)."""
    if not (_STATE["enabled"] and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    widths = (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1])
    return gate_up.dtype == down.dtype == torch.bfloat16 and all(w * 2 % 16 == 0 for w in widths)


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
# Gather-and-sum of the k rows of each token (Triton kernels and their tensor-op reference)

if triton is not None:

    @triton.jit
    def _combine_fwd_kernel(
        y_ptr,
        inv_ptr,
        w_ptr,
        out_ptr,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per token n: out[n, :] = sum_j w[n, j] * y[inv[n * K + j], :], float32 accumulation.
        n = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        jmask = j < K
        rows = tl.load(inv_ptr + n * K + j, mask=jmask, other=0).to(tl.int64)
        if HAS_W:
            w = tl.load(w_ptr + n * K + j, mask=jmask, other=0.0).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hmask = offs < H
            y = tl.load(
                y_ptr + rows[:, None] * H + offs[None, :], mask=jmask[:, None] & hmask[None, :], other=0.0
            ).to(tl.float32)
            if HAS_W:
                y = y * w[:, None]
            acc = tl.sum(y, axis=0)
            tl.store(out_ptr + n * H + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)

    @triton.jit
    def _combine_bwd_kernel(
        g_ptr,
        y_ptr,
        inv_ptr,
        w_ptr,
        gy_ptr,
        gw_ptr,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per token n: gy[inv[n, j], :] = w[n, j] * g[n, :]; gw[n, j] = <g[n, :], y[inv[n, j], :]>.
        n = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        jmask = j < K
        rows = tl.load(inv_ptr + n * K + j, mask=jmask, other=0).to(tl.int64)
        w = tl.load(w_ptr + n * K + j, mask=jmask, other=0.0).to(tl.float32)
        dots = tl.zeros([KP], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hmask = offs < H
            tile = jmask[:, None] & hmask[None, :]
            g = tl.load(g_ptr + n * H + offs, mask=hmask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + rows[:, None] * H + offs[None, :], mask=tile, other=0.0).to(tl.float32)
            dots += tl.sum(y * g[None, :], axis=1)
            gy = (w[:, None] * g[None, :]).to(gy_ptr.dtype.element_ty)
            tl.store(gy_ptr + rows[:, None] * H + offs[None, :], gy, mask=tile)
        tl.store(gw_ptr + n * K + j, dots, mask=jmask)


if triton is not None:

    @triton.jit
    def _swiglu_fwd_kernel(
        gu_ptr, w_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr
    ):
        # One program per row m: out[m, i] = w[m] * silu(gu[m, i]) * gu[m, WIDTH + i], float32 math,
        # one rounding (w = 1 without HAS_W).
        row = tl.program_id(0).to(tl.int64)
        if HAS_W:
            w = tl.load(w_ptr + row).to(tl.float32)
        for c0 in range(0, WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < WIDTH
            g = tl.load(gu_ptr + row * 2 * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + row * 2 * WIDTH + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            out = g * tl.sigmoid(g) * u
            if HAS_W:
                out = out * w
            tl.store(out_ptr + row * WIDTH + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        da_ptr, gu_ptr, w_ptr, dgu_ptr, dw_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr
    ):
        # With a = silu(g) u and out = w a: d gate = w da u sigma(g) (1 + g (1 - sigma(g))),
        # d up = w da silu(g), d w = sum_i da_i a_i (one program per row, so the sum needs no atomics).
        row = tl.program_id(0).to(tl.int64)
        w = 1.0
        if HAS_W:
            w = tl.load(w_ptr + row).to(tl.float32)
        dot = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
        for c0 in range(0, WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < WIDTH
            g = tl.load(gu_ptr + row * 2 * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + row * 2 * WIDTH + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            da = tl.load(da_ptr + row * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            if HAS_W:
                dot += tl.sum(da * silu * u, axis=0)
            dw_a = da * w
            dg = dw_a * u * sig * (1.0 + g * (1.0 - sig))
            du = dw_a * silu
            tl.store(dgu_ptr + row * 2 * WIDTH + cols, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
            tl.store(dgu_ptr + row * 2 * WIDTH + WIDTH + cols, du.to(dgu_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(dw_ptr + row, dot)


def _swiglu_meta(width: int) -> dict:
    block = min(2048, triton.next_power_of_2(width))
    return dict(WIDTH=width, BLOCK=block, num_warps=min(8, max(1, block // 256)))


class _SwiGLU(torch.autograd.Function):
    """[M, 2I] (gate columns, then up) and optional row weights [M] float32 -> w * silu(gate) * up [M, I];
    one Triton kernel forward and one backward."""

    @staticmethod
    def forward(ctx, gu, row_weights):  # noqa: D102
        gu = gu.contiguous()
        m, i = gu.shape[0], gu.shape[1] // 2
        has_w = row_weights is not None
        w = row_weights.float().contiguous() if has_w else gu
        out = torch.empty(m, i, dtype=gu.dtype, device=gu.device)
        if m:
            _swiglu_fwd_kernel[(m,)](gu, w, out, HAS_W=has_w, **_swiglu_meta(i))
        ctx.save_for_backward(gu, w if has_w else None)
        ctx.has_w = has_w
        return out

    @staticmethod
    def backward(ctx, da):  # noqa: D102
        gu, w = ctx.saved_tensors
        m, i = gu.shape[0], gu.shape[1] // 2
        dgu = torch.empty_like(gu)
        dw = torch.empty(m, dtype=torch.float32, device=gu.device) if ctx.has_w else None
        if m:
            _swiglu_bwd_kernel[(m,)](
                da.contiguous(),
                gu,
                w if ctx.has_w else gu,
                dgu,
                dw if ctx.has_w else gu,
                HAS_W=ctx.has_w,
                **_swiglu_meta(i),
            )
        return dgu, dw


def swiglu(gate_up: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """w * silu(gate) * up of x @ [gate; up]^T rows [M, 2I] -> [M, I] (Shazeer 2020, Eq. 5).

    Args:
        gate_up: [M, 2I] (gate columns first, then up), bfloat16/float16/float32.
        row_weights: optional [M] float32 per-row factor w (the top-k combine weight of each copy when
            ``fused_experts`` applies the weights before the down projection); None = 1.
    Returns:
        [M, I] in gate_up's dtype; differentiable in both inputs. On CUDA one Triton kernel forward and
        one backward (float32 math, one rounding); elsewhere tensor ops, the reference of the kernels.
    """
    if _use_triton(gate_up):
        return _SwiGLU.apply(gate_up, row_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    if row_weights is None:
        return (F.silu(gate) * up).contiguous()
    acc = accumulation_dtype_of(gate_up.dtype)
    act = F.silu(gate.to(acc)) * up.to(acc) * row_weights.to(acc)[:, None]
    return act.to(gate_up.dtype)


def accumulation_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 dtypes, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _kernel_meta(h: int, k: int) -> dict:
    kp = triton.next_power_of_2(k)
    return dict(K=k, KP=kp, BLOCK_H=min(triton.next_power_of_2(h), max(64, 4096 // kp)))


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and _STATE["enabled"]


def gather_sum_rows(
    y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, k: int
) -> torch.Tensor:
    """out[n] = sum_j w[n, j] * y[inverse[n * k + j]] (w = 1 when ``weights`` is None), float32 accumulation.

    Args:
        y: [M, H] rows (expert-sorted). inverse: [M] int64 row of each slot. weights: [N, k] float32 or None.
    Returns:
        [N, H] in y's dtype. No autograd (``fused_experts`` wraps it).
    """
    m, h = y.shape
    n = m // k
    if _use_triton(y):
        out = torch.empty(n, h, dtype=y.dtype, device=y.device)
        if n:
            w = weights.contiguous() if weights is not None else inverse  # dummy pointer when HAS_W=False
            _combine_fwd_kernel[(n,)](
                y.contiguous(), inverse, w, out, h, HAS_W=weights is not None, **_kernel_meta(h, k)
            )
        return out
    rows = y.index_select(0, inverse).view(n, k, h).float()
    if weights is not None:
        rows = rows * weights.float().unsqueeze(-1)
    return rows.sum(1).to(y.dtype)


class _PermuteRows(torch.autograd.Function):
    """x [N, H] -> x[token] [M, H] (token = order // k); backward sums each token's k row gradients."""

    @staticmethod
    def forward(ctx, x, token, inverse, k):  # noqa: D102
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (inverse,) = ctx.saved_tensors
        return gather_sum_rows(grad.contiguous(), inverse, None, ctx.k), None, None, None


class _WeightedCombine(torch.autograd.Function):
    """y [M, H], weights [N, k] float32 -> sum_j w[n, j] * y[inverse[n k + j]] [N, H] (Triton, CUDA)."""

    @staticmethod
    def forward(ctx, y, inverse, weights, k):  # noqa: D102
        y, weights = y.contiguous(), weights.float().contiguous()
        ctx.save_for_backward(y, inverse, weights)
        ctx.k = k
        return gather_sum_rows(y, inverse, weights, k)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        y, inverse, weights = ctx.saved_tensors
        m, h = y.shape
        n = m // ctx.k
        grad_y = torch.empty_like(y)
        grad_w = torch.empty(n, ctx.k, dtype=torch.float32, device=y.device)
        if n:
            _combine_bwd_kernel[(n,)](
                grad.contiguous(), y, inverse, weights, grad_y, grad_w, h, **_kernel_meta(h, ctx.k)
            )
        return grad_y, None, grad_w, None


def weighted_combine(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """Differentiable top-k combine of expert-sorted rows: [M, H], [M], [N, k] float32 -> [N, H].

    Triton kernels on CUDA; elsewhere the tensor-op reference (gather, float32 weighting, sum).
    """
    if _use_triton(y):
        return _WeightedCombine.apply(y, inverse, weights, k)
    n, h = weights.shape[0], y.shape[-1]
    rows = y.index_select(0, inverse).view(n, k, h).float()
    return (rows * weights.float().unsqueeze(-1)).sum(1).to(y.dtype)


class _SumRows(torch.autograd.Function):
    """y [M, H] -> sum_j y[inverse[n k + j]] [N, H] (unweighted combine); backward: g[token] [M, H]."""

    @staticmethod
    def forward(ctx, y, token, inverse, k):  # noqa: D102
        ctx.save_for_backward(token)
        return gather_sum_rows(y.contiguous(), inverse, None, k)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None, None


def fused_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts with no host sync: the function of ``moerl.models.moe.Experts.forward``.

    The combine weight of each copy is applied before the down projection, where the SwiGLU kernel
    produces w * silu(g) * u in one pass (down is linear, so down(w a) = w down(a)); the combine is then
    a plain sum of each token's k rows, and its backward a row gather. Compared with weighting the
    [M, H] expert outputs this saves the [M, H] outputs and the [M, I] activation for the backward and
    three passes over [M, I]; the weight gradient d w = sum_i d(w a)_i a_i is a row dot product formed in
    the SwiGLU backward kernel.

    Args:
        x: [N, H] tokens (bfloat16 on CUDA for the fast path; float32/bfloat16 on CPU for tests).
        topk_idx: [N, k] int64 expert ids in [0, E) (out-of-range ids are not checked: that would sync).
        topk_weights: [N, k] float32 combine weights.
        gate_up: [E, 2I, H] (gate rows first, then up). down: [E, H, I].
    Returns:
        [N, H] in x's dtype; differentiable in x, topk_weights, gate_up and down.
    """
    n, k = topk_idx.shape
    order, inverse, offsets, token, row_weights = expert_layout(
        topk_idx, topk_weights.detach(), gate_up.shape[0]
    )
    if topk_weights.requires_grad and torch.is_grad_enabled():  # the gradient needs a differentiable gather
        row_weights = topk_weights.reshape(-1).float().index_select(0, order)
    x_sorted = _PermuteRows.apply(x, token, inverse, k)
    if small_grouped_mm_supported(x_sorted, gate_up):  # decode: few rows per expert, no gradient
        act = swiglu(small_grouped_mm(x_sorted, gate_up, offsets), row_weights)
        y = small_grouped_mm(act, down, offsets)
    else:
        gate_up_out = torch._grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=offsets)
        act = swiglu(gate_up_out, row_weights)  # [M, I] = w * silu(gate) * up, w the copy's combine weight
        y = torch._grouped_mm(act, down.transpose(-2, -1), offs=offsets)
    return _SumRows.apply(y, token, inverse, k)


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
