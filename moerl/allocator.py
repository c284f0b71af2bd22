"""Keep freed heap memory in the process instead of handing it back to the kernel (glibc only).

A CPU train step allocates and frees the same few hundred activation tensors every step, most of them
between 128 KiB and a few MiB. glibc's malloc serves blocks that size with ``mmap`` or returns the top
of its heap to the kernel on ``free`` (``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``, mallopt(3)), so
the next step touches fresh pages again: about 540 minor page faults per trainer step of the default
config, each a trip through the (virtualized) kernel. Raising both thresholds keeps the memory in
malloc's free lists; the step then page-faults ~0 times. The price is that the process's resident
memory stays at its peak instead of shrinking between steps.

The same effect is available from the environment (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``), which must be set before the process starts; ``mallopt`` works from inside
a running process, which is what the CLI and the Ray actors need.

``freeze_long_lived`` does the same for Python's cyclic garbage collector: a run's process holds a few
hundred thousand objects that live as long as it does (imported modules: torch alone brings most of
them, the model, the engine), and each full (generation 2) collection walks all of them, about 0.3 s on
the 2-core machine, several times a minute on the default config. Frozen (``gc.freeze``), they are left
out of every later collection, which then walks only what the steps themselves create. A run unfreezes
them when it ends (``unfreezes_on_exit``), so that a process running several runs (``moerl.api.train``
in a notebook or a test session) can collect what each run left in reference cycles.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Iterator

M_TRIM_THRESHOLD = -1  # mallopt(3) parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def keep_freed_memory(*, mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1024**3) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (mallopt(3)).

    Args:
        mmap_threshold: bytes; blocks at least this large still get their own ``mmap``. At most
            ``MMAP_THRESHOLD_MAX`` (32 MiB), glibc's ceiling on 64-bit.
        trim_threshold: bytes of free memory at the top of the heap before malloc gives it back.

    Returns:
        True when both settings took effect; False where there is no glibc (macOS, musl) or glibc
        refused a value. Nothing changes then, and nothing is raised: this is a speed setting.

    Raises:
        ValueError: a threshold is negative, or ``mmap_threshold`` is above ``MMAP_THRESHOLD_MAX``.
    """
    if mmap_threshold < 0 or trim_threshold < 0:
        raise ValueError(f"thresholds must be >= 0 bytes, got {mmap_threshold=} {trim_threshold=}")
    if mmap_threshold > MMAP_THRESHOLD_MAX:
        raise ValueError(f"{mmap_threshold=} is above glibc's ceiling of {MMAP_THRESHOLD_MAX} bytes")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no libc by that name, or a libc without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on a rejected value
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) & bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def freeze_long_lived() -> int:
    """Collect the cyclic garbage now, then freeze every object still tracked by the garbage collector
    (``gc.collect``, ``gc.freeze``): later collections skip them (module docstring). Called where a
    process has built what it keeps (imports, model, engine) and before its steps.

    Frozen objects are still freed by reference counting when their last reference goes; only cycles
    among them are never collected, which is why the garbage is collected first. Results do not change:
    the collector frees memory, it never touches tensor values.

    Returns:
        The number of frozen objects (``gc.get_freeze_count``), cumulative over calls.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def unfreezes_on_exit() -> Iterator[None]:
    """Hand every frozen object back to the garbage collector (``gc.unfreeze``) when the block ends, how
    it ends: what ``freeze_long_lived`` froze inside it becomes collectable again. Objects the caller
    froze before the block are unfrozen too (the collector has one permanent generation)."""
    try:
        yield
    finally:
        gc.unfreeze()
