"""The process-wide switch of moerl's CUDA fast paths (``moerl.models.kernels``, ``moe_kernels``,
``layer_kernels``): on by default; ``fast_paths(False)`` runs the eager reference code instead (for
agreement checks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:  # Triton is optional: CPU installs and CUDA machines without it use the tensor-op fallbacks.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

_STATE = {"enabled": True, "reference_rounding": True}


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


def set_reference_rounding(enabled: bool) -> bool:
    """Whether the elementwise fast paths (rotary forward, SwiGLU forward) round their intermediate
    results to the tensor dtype where the eager reference code does (one rounding per eager op), instead
    of keeping float32 until a single final rounding. On by default: the fast path then makes the same
    bf16 roundings as the reference path, so the two agree far more closely (the agreement checks of
    ``bench/rollout_gpu.py``); the cost is nil (the kernels are memory-bound). Returns the previous setting."""
    prev = _STATE["reference_rounding"]
    _STATE["reference_rounding"] = bool(enabled)
    return prev


def reference_rounding_enabled() -> bool:
    """See ``set_reference_rounding``."""
    return _STATE["reference_rounding"]


def rounding_mode(dtype: torch.dtype) -> int:
    """The kernels' ``ROUND`` constexpr for outputs of ``dtype``: 2 = round intermediates to bfloat16 by bit
    arithmetic (``round_bf16``), 1 = to float16 by casts, 0 = no intermediate rounding (float32 outputs,
    or reference rounding off)."""
    if not _STATE["reference_rounding"]:
        return 0
    return {torch.bfloat16: 2, torch.float16: 1}.get(dtype, 0)


if triton is not None:

    @triton.jit
    def round_bf16(v):
        """float32 -> nearest bfloat16 (ties to even), returned as float32. Bit arithmetic on purpose: the
        compiler folded a plain float32 -> bfloat16 -> float32 cast pair (seen on the H200, 2026-12-01: the
        rounded rotary matched the eager code on 84% of elements, as the unrounded one does). No NaN care."""
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)

else:  # pragma: no cover - depends on the install
    round_bf16 = None


def use_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel should serve a call on ``t``: Triton present, CUDA tensor, fast paths on."""
    return triton is not None and t.is_cuda and _STATE["enabled"]
