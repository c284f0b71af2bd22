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


def use_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel should serve a call on ``t``: Triton present, CUDA tensor, fast paths on."""
    return triton is not None and t.is_cuda and _STATE["enabled"]
