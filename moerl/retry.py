"""Retries of remote storage operations (fsspec: s3fs, gcsfs, ...) with exponential backoff, ending in one
line that names the operation: run storage (``moerl.rundir.storage``) and the weight store's reads
(``moerl.weights.store``) share it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from moerl.errors import StorageError

T = TypeVar("T")
log = logging.getLogger("moerl.storage")


def with_retries(what: str, fn: Callable[[], T], *, attempts: int = 3, backoff_s: float = 0.5) -> T:
    """``fn()``, tried up to ``attempts`` times (>= 1): after a failure it waits ``backoff_s`` seconds,
    doubled after each further one. ``FileNotFoundError`` is an answer, not a fault: raised at once.

    Args:
        what: the operation and its URL, for the log line and the error (e.g. ``"download of s3://b/k"``).

    Raises:
        StorageError: every attempt failed; one line: ``storage: <what> failed after N attempts: <Type>:
            <the last error's message>``.
    """
    wait = backoff_s
    for attempt in range(1, max(1, attempts) + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as e:  # s3fs/botocore/aiohttp raise many types for one failed request
            if attempt >= attempts:
                message = " ".join(str(e).split())  # one line, whatever the backend put in it
                raise StorageError(
                    f"storage: {what} failed after {attempt} attempts: {type(e).__name__}: {message}"
                ) from e
            log.warning("storage: %s failed (%s), retrying in %.1f s", what, e, wait)
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
