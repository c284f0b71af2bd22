"""Fast paths of the transformer layers on CUDA (Triton): RMSNorm and the rotary embedding.

Shape legend: D normalized width, B batch, n heads, T tokens, d head dim.

``fused_rmsnorm`` is RMSNorm (Zhang & Sennrich 2019, Eq. 4) in one kernel forward and one backward,
rounding like ``moerl.models.layers.RMSNorm`` (normalize in float32, round to the input dtype, multiply
by the weight in the input dtype) where the eager version launches about seven kernels per call.
``fused_rotary`` applies a rotary embedding (RoFormer, Su et al. 2021, Eq. 34; pairs (x_i, x_{i+d/2}))
in one kernel each way instead of five, with float32 math and one rounding.

``moerl.models.layers.RMSNorm`` calls ``fused_rmsnorm`` when ``fused_rmsnorm_supported`` passes and
``moerl.models.layers.apply_rotary`` calls ``fused_rotary`` when ``fused_rotary_supported`` passes (CUDA,
Triton, fast paths on: ``moerl.models.fast_paths``); otherwise the eager code runs, which is
the reference ``bench/gpu_checks.py`` checks the kernels against.
"""

from __future__ import annotations

import torch

from moerl.models.fast_paths import fast_paths_enabled, round_bf16, rounding_mode

try:  # optional, as in moerl.models.kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# ----------------------------------------------------------------------------------------------
# RMSNorm: y = w * round(x / sqrt(mean(x^2) + eps)) (Zhang & Sennrich 2019, Eq. 4), rows of width D

if triton is not None:

    @triton.jit
    def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        xn = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + cols, (xn * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rmsnorm_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, D: tl.constexpr, BLOCK: tl.constexpr
    ):
        # One program per row: dx = r (g - x r^2 mean(g x)) with g = dy w; the row's weight-gradient
        # term dy * x r goes to row `row` of dw_ptr [rows, D] float32 (summed over rows afterwards).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + row)
        xn = x * r
        g = dy * w
        dx = r * (g - xn * (tl.sum(g * xn, axis=0) / D))
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + row * D + cols, dy * xn, mask=mask)


def fused_rmsnorm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fused_rmsnorm`` should serve this call: fast paths on, Triton present, CUDA input with the
    weight's dtype, rows of at most 16384 elements."""
    return (
        fast_paths_enabled()
        and triton is not None
        and x.is_cuda
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.shape[-1] <= 16384
    )


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: D102
        d = x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(d)
        if x2.shape[0]:
            _rmsnorm_fwd_kernel[(x2.shape[0],)](
                x2, weight, y, rstd, eps, D=d, BLOCK=block, num_warps=_norm_warps(block)
            )
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x2, weight, rstd = ctx.saved_tensors
        rows, d = x2.shape
        dx = torch.empty_like(x2)
        dw_rows = torch.empty(rows, d, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(d)
        if rows:
            _rmsnorm_bwd_kernel[(rows,)](
                dy.reshape(-1, d).contiguous(),
                x2,
                weight,
                rstd,
                dx,
                dw_rows,
                D=d,
                BLOCK=block,
                num_warps=_norm_warps(block),
            )
        return dx.view(dy.shape), dw_rows.sum(0).to(weight.dtype), None


def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last axis of x [..., D] with weight [D]; one Triton kernel forward and backward.

    Rounds like ``moerl.models.layers.RMSNorm``: x / sqrt(mean(x^2) + eps) in float32, rounded to x's
    dtype, times the weight, rounded again. Use ``fused_rmsnorm_supported`` first (CUDA + Triton).
    """
    return _RMSNorm.apply(x, weight, eps)


# ----------------------------------------------------------------------------------------------
# Rotary embedding: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (halves of the head dim; RoFormer Eq. 34)

if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        c_ptr,
        s_ptr,
        y_ptr,
        sxb,
        sxh,
        sxt,
        syb,
        syh,
        syt,
        num_heads,
        seq_len,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        BACKWARD: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # One program per (b, h, t) row. Backward is the transpose: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1.
        row = tl.program_id(0).to(tl.int64)
        t = row % seq_len
        h = (row // seq_len) % num_heads
        b = row // (seq_len * num_heads)
        cols = tl.arange(0, BLOCK)
        mask = cols < HALF
        xb = x_ptr + b * sxb + h * sxh + t * sxt
        x1 = tl.load(xb + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        cb = (b * seq_len + t) * 2 * HALF
        c1 = tl.load(c_ptr + cb + cols, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(c_ptr + cb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s_ptr + cb + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s_ptr + cb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        elif ROUND == 2:  # as the eager code: each product rounded to bfloat16, then the sum
            y1 = round_bf16(x1 * c1) - round_bf16(x2 * s1)
            y2 = round_bf16(x2 * c2) + round_bf16(x1 * s2)
        elif ROUND == 1:
            dt = y_ptr.dtype.element_ty
            y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
            y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        yb = y_ptr + b * syb + h * syh + t * syt
        tl.store(yb + cols, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(yb + HALF + cols, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _rotary_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)
    bsz, heads, seq, d = x.shape
    if x.numel():
        half = d // 2
        _rotary_kernel[(bsz * heads * seq,)](
            x,
            cos,
            sin,
            y,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            y.stride(0),
            y.stride(1),
            y.stride(2),
            heads,
            seq,
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            BACKWARD=backward,
            ROUND=rounding_mode(x.dtype) if cos.dtype == x.dtype else 0,
        )
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):  # noqa: D102
        ctx.save_for_backward(cos, sin)
        return _rotary_launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        cos, sin = ctx.saved_tensors
        return _rotary_launch(grad, cos, sin, backward=True), None, None


def fused_rotary_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> bool:
    """Whether ``fused_rotary`` serves this call: fast paths on, Triton, CUDA, the rotation covers the whole
    even head dim in half-split pairs (not interleaved), cos/sin [B, T, d] contiguous without gradients."""
    return (
        fast_paths_enabled()
        and triton is not None
        and x.is_cuda
        and not interleave
        and x.dim() == 4
        and x.shape[-1] % 2 == 0
        and cos.shape == sin.shape == (x.shape[0], x.shape[2], x.shape[3])
        and cos.is_contiguous()
        and sin.is_contiguous()
        and not (cos.requires_grad or sin.requires_grad)
    )


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, n, T, d] with cos, sin [B, T, d] (``moerl.models.layers.apply_rotary`` with
    R = d, not interleaved): one Triton kernel forward and backward, float32 math; the forward rounds each
    product and the sum to x's dtype as the eager code does (``set_reference_rounding``), the backward once.
    Use ``fused_rotary_supported`` first."""
    return _Rotary.apply(x, cos, sin)
