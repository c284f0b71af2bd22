"""Input checks shared by the moerl.rl functions: every error names the offending tensor."""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless all given (non-``None``) tensors have the same shape.

    The message names every tensor with its shape, e.g. ``shape mismatch: logp (2, 3), mask (2, 4)``.
    """
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = {tuple(t.shape) for t in given.values()}
    if len(shapes) > 1:
        listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in given.items())
        raise ValueError(f"shape mismatch: {listed}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, legend: str) -> None:
    """Raise ``ValueError`` unless ``t`` has ``ndim`` dimensions; ``legend`` is e.g. ``"[B, T]"``."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {legend}, got {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the first bad index if ``t`` has NaN or +-inf.

    Causes a device sync (one boolean read back).
    """
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        count = int(bad.sum())
        raise ValueError(
            f"{name} has {count} non-finite value(s) (NaN or inf); first at index {first}: {t[first].item()}"
        )


def as_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor (True = position counts); accepts bool or 0/1 numbers."""
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or 0/1 numbers, got dtype {mask.dtype}")
    return mask != 0
