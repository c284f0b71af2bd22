"""How a run stops on Ctrl-C or SIGTERM: ``RunInterrupted`` and the SIGTERM handler of ``moerl.train``."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from moerl.runtime.checkpoint import latest_checkpoint


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run; workers were stopped and the newest checkpoint stays.

    Args:
        folder: the run folder, or None when it was removed (stopped before its first step).
        resumable: True when ``folder`` holds a checkpoint that ``resume`` continues from.
    """

    def __init__(self, folder: Path | None, resumable: bool) -> None:
        super().__init__(f"run interrupted: {folder}")
        self.folder = folder
        self.resumable = resumable

    @property
    def run_dir(self) -> Path | None:
        """The folder to pass to ``resume`` (``moerl train --resume``), or None when it cannot be resumed."""
        return self.folder if self.resumable else None

    @property
    def partial_run_dir(self) -> Path | None:
        """The folder holding the metrics so far, resumable or not; None when it was removed."""
        return self.folder

    @classmethod
    def of(cls, path: Path) -> RunInterrupted:
        """The interrupt of the run in folder ``path`` (which may be gone)."""
        exists = path.is_dir()
        return cls(path if exists else None, exists and latest_checkpoint(path) is not None)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """While a run lasts, SIGTERM (a scheduler or ``kill`` stopping the job) stops it as Ctrl-C does:
    workers are stopped, the newest checkpoint stays, and the CLI prints the ``--resume`` hint and exits
    130. The previous handler comes back afterwards. Only from the main thread (Python's rule).
    ``init_ray`` keeps it across ``ray.init``, which would install Ray's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
