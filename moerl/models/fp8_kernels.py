"""FP8 weight-only GEMM on CUDA (Triton): out = x @ W^T with W block-quantized (``moerl.models.fp8``).

One kernel serves the dense layers (one "expert") and the routed experts (expert-sorted rows with
cumulative ``offsets``, as ``moerl.models.moe_kernels.small_grouped_mm``). A program owns one 128-wide
tile of output features of one expert; the tile is exactly one row of scale blocks, so each 128-deep
step of the reduction reads one float32 scale: acc += (x_tile @ W_q_tile^T) * s. The FP8 tile is
converted to bf16 in registers (exact: every e4m3 value is a bf16 value) and fed to the bf16 tensor
cores; the activations are not quantized. Why Triton and not ``torch._scaled_mm``: in torch 2.11 it
takes per-tensor or row-wise scales only, not 128 x 128 blocks; the per-block-column loop of scaled_mm
calls it would need (K/128 launches per layer) costs more than it saves at decode sizes.

Without Triton, or off CUDA, or for activations other than bf16, ``fp8_mm_supported`` is False and the
callers take the reference path (dequantize, then an ordinary matmul): that fallback is explicit.
"""

from __future__ import annotations

import torch

from moerl.models.fast_paths import use_triton

try:  # Triton is optional: CPU installs and CUDA machines without it use the reference path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

FP8_BLOCK = 128
"""The scale block side the kernel assumes (its BLOCK_N and BLOCK_K)."""

if triton is not None:

    @triton.jit
    def _fp8_grouped_mm_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        offs_ptr,
        N,
        K,
        NB,
        KB,
        M_SPLITS,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (n tile, expert e, m split): rows [start, end) of expert e, every M_SPLITS-th BLOCK_M
        # block of them; out[rows, n tile] = sum_kb (x[rows, kb] @ W_q[e, n tile, kb]^T) * S[e, n tile, kb].
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        pid_m = tl.program_id(2)
        end = tl.load(offs_ptr + e).to(tl.int64)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
        n = pid_n * BLOCK + tl.arange(0, BLOCK)
        nm = n < N
        kk = tl.arange(0, BLOCK)
        w_base = w_ptr + e.to(tl.int64) * N * K + n[:, None].to(tl.int64) * K
        s_base = s_ptr + e.to(tl.int64) * NB * KB + pid_n * KB
        for m0 in range(start + pid_m * BLOCK_M, end, BLOCK_M * M_SPLITS):
            m = m0 + tl.arange(0, BLOCK_M)
            mm = m < end
            acc = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
            for kb in range(0, KB):
                k = kb * BLOCK + kk
                km = k < K
                a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
                # the FP8 bytes are read as uint8 (a masked lane loads 0 = +0.0) and reinterpreted
                b = tl.load(w_base + k[None, :], mask=nm[:, None] & km[None, :], other=0)
                b = b.to(tl.float8e4nv, bitcast=True).to(a.dtype)
                s = tl.load(s_base + kb)
                acc += tl.dot(a, tl.trans(b)) * s
            tl.store(
                out_ptr + m[:, None] * N + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=mm[:, None] & nm[None, :],
            )


def fp8_mm_supported(x: torch.Tensor) -> bool:
    """Whether the Triton FP8 GEMM serves activations ``x``: Triton present, CUDA, fast paths on
    (``moerl.models.fast_paths``), bf16 activations, no gradient needed (rollout only)."""
    return use_triton(x) and x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and x.requires_grad)


def fp8_grouped_mm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scale_inv: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """out[m] = x[m] @ W[e(m)]^T for expert-sorted rows, W the block-dequantized weight (CUDA, Triton).

    Args:
        x: [M, K] bf16 rows sorted by expert.
        w_q: [E, N, K] float8_e4m3fn. scale_inv: [E, ceil(N/128), ceil(K/128)] float32.
        offsets: [E] int32 cumulative row ends (offsets[-1] = M).
        block_m: rows per program step (16 or more); None: 16 for decode-sized calls, else 64.
    Returns:
        [M, N] in x's dtype (float32 accumulation). No autograd, no host sync.
    Raises:
        RuntimeError: Triton is not installed (check ``fp8_mm_supported`` first).
    """
    if triton is None:
        raise RuntimeError("fp8_grouped_mm needs Triton; use the reference path (dequantize_blockwise)")
    m, k = x.shape
    e, n, _ = w_q.shape
    nb, kb = scale_inv.shape[-2:]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if block_m is None:
        block_m = 16 if m <= 16 * e else 64
    # rows of one expert are split over M_SPLITS programs (prefill); the expert sizes are on the device,
    # so the split is sized from the mean and programs past an expert's end exit at once
    m_splits = max(1, min(64, triton.cdiv(triton.cdiv(m, e), block_m)))
    _fp8_grouped_mm_kernel[(triton.cdiv(n, FP8_BLOCK), e, m_splits)](
        x.contiguous(), w_q.contiguous().view(torch.uint8), scale_inv.contiguous(), out, offsets, n, k, nb, kb,
        m_splits,
        BLOCK_M=block_m, BLOCK=FP8_BLOCK, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
