"""Process-wide communication-error counters, kept where errors are caught and read by the exporter.

Code that catches a collective timeout or a transport error calls ``count_comm_error(kind)`` (or
``count_comm_error(classify_comm_error(exc))``); the driver's exporter adds this process's counts to
the ones rollout workers report in their heartbeats (``WorkerHealth.comm_errors``). No dependency
beyond the standard library, so that every process may import it.
"""

from __future__ import annotations

import threading

COMM_ERROR_KINDS: tuple[str, ...] = ("timeout", "transport", "rpc", "provider")
"""Kinds of communication error: ``timeout`` (a collective or RPC that ran past its deadline),
``transport`` (an NCCL, gloo or libfabric error raised by torch.distributed), ``rpc`` (a Ray call that
failed for a reason other than its actor's death), ``provider`` (a cloud provider endpoint that failed:
the spot-notice endpoint, ``moerl.runtime.notice.HttpNotice``)."""

_lock = threading.Lock()
_counts = dict.fromkeys(COMM_ERROR_KINDS, 0)


def count_comm_error(kind: str, n: int = 1) -> None:
    """Count ``n`` errors of ``kind`` in this process.

    Raises:
        ValueError: ``kind`` is not one of ``COMM_ERROR_KINDS``.
    """
    if kind not in COMM_ERROR_KINDS:
        raise ValueError(f"comm error kind {kind!r}: expected one of {COMM_ERROR_KINDS}")
    with _lock:
        _counts[kind] += n


def comm_error_counts() -> dict[str, int]:
    """This process's counts so far, every kind present (0 when none)."""
    with _lock:
        return dict(_counts)


def classify_comm_error(exc: BaseException) -> str:
    """The kind of a caught communication error: ``timeout`` for ``TimeoutError`` (and torch's
    ``DistError`` whose message says timed out / timeout), ``transport`` for other torch.distributed
    errors, ``rpc`` for anything else (e.g. a ``RayError``)."""
    if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        return "timeout"
    if type(exc).__module__.startswith("torch.distributed") or type(exc).__name__.startswith("Dist"):
        return "transport"
    return "rpc"
