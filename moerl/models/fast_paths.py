"""The process-wide switch of moerl's CUDA fast paths (``moerl.models.kernels``, ``moe_kernels``,
``layer_kernels``): on by default; ``fast_paths(False)`` runs the eager reference code instead (for
agreement checks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:  # Triton is optional: CPU installs and CUDA machines without it use the tensor-op fallbacks.
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

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


def use_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel should serve a call on ``t``: Triton present, CUDA tensor, fast paths on."""
    return triton is not None and t.is_cuda and _STATE["enabled"]
