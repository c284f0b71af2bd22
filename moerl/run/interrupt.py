"""How a run stops on Ctrl-C or SIGTERM (``RunInterrupted`` and the SIGTERM handler of ``moerl.train``) or on
a full disk (``stops_on_full_disk``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from moerl.errors import DiskFullError, ExchangeLostError
from moerl.trainer.checkpoint import latest_checkpoint


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
        # structure only: this process wrote its checkpoints; reading every byte would delay the exit
        return cls(path if exists else None, exists and latest_checkpoint(path, contents=False) is not None)


_STOPPING = b"moerl: already stopping (workers and Ray are being shut down; the newest checkpoint stays)\n"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _already_stopping(signum, frame) -> None:
    os.write(2, _STOPPING)  # not print(): a handler may run in the middle of another write to stderr


def ignore_further_interrupts() -> None:
    """From now on Ctrl-C and SIGTERM print one line and are otherwise ignored (main thread only).

    A run's first interrupt installs this: a second KeyboardInterrupt raised inside the shutdown (the
    fleet's, or Ray's own at exit) left a traceback, orphaned Ray processes and once a segfault. The CLI
    installs it again after the run's handlers are restored, for the exit itself. ``kill -9`` still ends
    the process."""
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            signal.signal(sig, _already_stopping)


@contextlib.contextmanager
def stops_on_full_disk(folder: Path):
    """Around a run in ``folder``: a write that finds no space left or the quota spent (``ENOSPC``,
    ``EDQUOT``) becomes a ``DiskFullError`` with the same facts as an interrupt (the folder, if left, and
    whether a checkpoint resumes it), which ``moerl train`` prints as one line with the resume command.
    Other errors pass unchanged. Enter it outside ``RunDir.discarded_on_early_failure`` (which removes an
    unstarted folder first)."""
    try:
        yield
    except OSError as e:
        if e.errno not in DiskFullError.ERRNOS:
            raise
        stopped = RunInterrupted.of(folder)
        raise DiskFullError(e, stopped.folder, stopped.resumable) from e


@contextlib.contextmanager
def stops_on_lost_exchange(folder: Path):
    """Around a run in ``folder``: an ``ExchangeLostError`` (the queue/buffer actor died with its node)
    gets the run folder and whether a checkpoint resumes it, which ``moerl train`` prints as one line with
    the resume command. Other errors pass unchanged."""
    try:
        yield
    except ExchangeLostError as e:
        stopped = RunInterrupted.of(folder)
        e.folder, e.resumable = stopped.folder, stopped.resumable
        raise


def _raise_interrupt(signum, frame) -> None:
    ignore_further_interrupts()
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """While a run lasts, SIGTERM (a scheduler or ``kill`` stopping the job) stops it as Ctrl-C does:
    workers are stopped, the newest checkpoint stays, and the CLI prints the ``--resume`` hint and exits
    130. Either signal, once caught, makes later ones print a line and be ignored while the run shuts
    down (``ignore_further_interrupts``). The previous handlers come back afterwards. Only from the main
    thread (Python's rule). ``init_ray`` keeps them across ``ray.init``, which would install Ray's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
