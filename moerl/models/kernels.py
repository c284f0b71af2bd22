"""Fast paths of the MoE experts on CUDA: sync-free permutation, SwiGLU and weighted combine (Triton).

Shape legend: N tokens, H hidden size, E experts, k experts per token (top-k), I expert intermediate
size, M = N * k expert-sorted token copies ("rows"); a "slot" is one (token, choice) pair, flat index
n * k + j.

``fused_experts`` computes the function of ``moerl.models.moe.Experts.forward``,
y_n = sum_j w_nj * down_e(silu(g) * u) with [g, u] = gate_up_e x_n and e = topk_idx[n, j]
(SwiGLU experts, Shazeer 2020 Eq. 5; top-k combine, Shazeer et al. 2017 Eq. 1), in a form that

- never waits for the device: the per-expert row offsets come from a counting sort
  (``moe_kernels.expert_layout``) instead of ``torch.bincount`` (whose CUDA kernel reads the input's
  maximum on the host), so a decode step that uses it can be captured in a CUDA graph;
- runs both expert projections as one grouped GEMM each (``torch._grouped_mm``; for decode batches
  without gradients ``moe_kernels.small_grouped_mm``);
- applies the combine weights inside the SwiGLU kernel (w * silu(g) * u, before the down projection,
  which is linear) and sums the k expert outputs of each token in one Triton kernel that gathers the
  k rows in float32 and writes the token once (no [M, H] weighting pass, no bfloat16 atomics); the
  backward of that sum is a row gather, the weight gradients are row dot products in the SwiGLU
  backward kernel, and the permutation's backward is the same gather-and-sum, so the backward has no
  atomics and is deterministic.

The expert layout, routing and decode GEMM kernels are in ``moerl.models.moe_kernels``, the
attention-side kernels (RMSNorm, rotary embedding) in ``moerl.models.layer_kernels``; the switch
``fast_paths`` (``moerl.models.fast_paths``, re-exported here) covers all of them.

Without Triton (or on CPU) the same functions run as plain tensor ops, which is also the reference the
unit tests compare the kernels against. ``fast_paths(False)`` turns the fast paths off (for agreement
checks against the reference path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerl.models.fast_paths import (
    _STATE,
    fast_paths,
    fast_paths_enabled,
    reference_rounding_enabled,
    round_bf16,
    rounding_mode,
    set_fast_paths,
    set_reference_rounding,
)
from moerl.models.fast_paths import use_triton as _use_triton
from moerl.models.moe_kernels import (
    SMALL_GROUPED_MM,
    expert_layout,
    expert_order_no_sync,
    small_grouped_mm,
    small_grouped_mm_supported,
)

try:  # Triton is optional: CPU installs and CUDA machines without it use the tensor-op fallbacks.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def fused_experts_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``fused_experts`` should serve this call: fast paths on, a CUDA bfloat16 input,
    ``torch._grouped_mm`` present and every row stride 16-byte aligned (its requirement)."""
    if not (_STATE["enabled"] and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    widths = (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1])
    return gate_up.dtype == down.dtype == torch.bfloat16 and all(w * 2 % 16 == 0 for w in widths)


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
        gu_ptr,
        w_ptr,
        out_ptr,
        WIDTH: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_W: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # One program per row m: out[m, i] = w[m] * silu(gu[m, i]) * gu[m, WIDTH + i], float32 math
        # (w = 1 without HAS_W); ROUND rounds silu(g) and silu(g) * u to the tensor dtype first, as the
        # eager F.silu(gate) * up does, else one rounding at the end.
        row = tl.program_id(0).to(tl.int64)
        if HAS_W:
            w = tl.load(w_ptr + row).to(tl.float32)
        for c0 in range(0, WIDTH, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < WIDTH
            g = tl.load(gu_ptr + row * 2 * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + row * 2 * WIDTH + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
            if ROUND == 2:
                out = round_bf16(round_bf16(g * tl.sigmoid(g)) * u)
            elif ROUND == 1:
                dt = out_ptr.dtype.element_ty
                out = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
            else:
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
            _swiglu_fwd_kernel[(m,)](
                gu, w, out, HAS_W=has_w, ROUND=rounding_mode(gu.dtype), **_swiglu_meta(i)
            )
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
        one backward (float32 math; the forward rounds as the eager product does unless
        ``set_reference_rounding(False)``); elsewhere tensor ops, the reference of the kernels.
    """
    if _use_triton(gate_up):
        return _SwiGLU.apply(gate_up, row_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    if row_weights is None:
        return (F.silu(gate) * up).contiguous()
    acc = accumulation_dtype_of(gate_up.dtype)
    if reference_rounding_enabled():  # as the kernel: the eager product first, then the weight
        return ((F.silu(gate) * up).to(acc) * row_weights.to(acc)[:, None]).to(gate_up.dtype)
    act = F.silu(gate.to(acc)) * up.to(acc) * row_weights.to(acc)[:, None]
    return act.to(gate_up.dtype)


def accumulation_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 dtypes, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _kernel_meta(h: int, k: int) -> dict:
    kp = triton.next_power_of_2(k)
    return dict(K=k, KP=kp, BLOCK_H=min(triton.next_power_of_2(h), max(64, 4096 // kp)))


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


__all__ = [  # the switch and the routing-side functions are re-exported for existing callers
    "SMALL_GROUPED_MM",
    "expert_layout",
    "expert_order_no_sync",
    "fast_paths",
    "fast_paths_enabled",
    "fused_experts",
    "fused_experts_supported",
    "gather_sum_rows",
    "reference_rounding_enabled",
    "set_fast_paths",
    "set_reference_rounding",
    "small_grouped_mm",
    "swiglu",
    "weighted_combine",
]
