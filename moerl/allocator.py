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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

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
