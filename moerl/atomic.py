"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

Every file another process may read (configs, summaries, ledgers, notices, tokenizers, reports) is
written through here: to a temporary file in the same folder (so the rename stays on one filesystem),
flushed and fsynced, made readable by all (``mkstemp`` creates 0600; outputs are shared), then renamed
over the target with ``os.replace``. On an error the temporary file is removed and the target is left
as it was. Folders (checkpoints, model folders) and object stores have their own renames
(``moerl.trainer.checkpoint``, ``moerl.models.checkpoint``, ``moerl.weights.store``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that wants a file name (``savefig``); renamed over
    ``path`` when the block ends without an error, removed otherwise. Missing parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (module docstring)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (module docstring)."""
    atomic_write_bytes(path, text.encode("utf-8"))
