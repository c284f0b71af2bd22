"""The run folder: where a training run writes everything a person or a resumed run reads back.

Layout (``runs/<name>-<timestamp>/``)::

    config.yaml        resolved RunConfig
    metrics.jsonl      one record per trainer step (schema: moerl.telemetry.metrics.METRIC_KEYS)
    summary.json       final figures and exactly-once task accounting
    ledger.jsonl       one line per trained task: {"task_id", "step", "policy_version", "lease_token",
                       "versions", "tokens_resumed"}
    eval_samples.jsonl the sampled held-out responses (eval.k): {"step", "set", "k", "prompt_id", ...}
    checkpoints/       step_N/ full run state (moerl.trainer.checkpoint: save/load/latest_checkpoint)
    weights/           published weight versions (the default WeightStore)
    report.png         curves against step and wall time
    run.lock           held (``flock``) by the one process that runs or resumes the run: ``RunFolderLock``

Every file that another process may read is written atomically (temp file, then ``os.replace``);
append-only JSONL files are flushed per line and cut back to a step on resume.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moerl.atomic import atomic_write_text
from moerl.config import ConfigError, RunConfig, save_config
from moerl.errors import RunFolderInUseError

LOCK_FILE = "run.lock"
"""The run folder's lock file (``RunFolderLock``): empty, only ``flock``-ed."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file; ``[]`` if it does not exist. A torn last line is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash: everything after it is untrusted
    return records


def truncate_jsonl(path: str | Path, keep) -> int:
    """Rewrite a JSONL file keeping only records where ``keep(record)`` is true; returns how many."""
    records = [r for r in read_jsonl(path) if keep(r)]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return len(records)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One trained task: the exactly-once record."""

    task_id: str
    """Stable task id (the prompt id)."""
    step: int
    """Trainer step (1-based) whose batch contained the task's group."""
    policy_version: int
    """Oldest policy version that generated the group."""
    lease_token: int
    """Fencing token of the lease under which the group was delivered."""
    versions: tuple[int, ...] = ()
    """The distinct policy versions that generated the group's tokens, ascending (empty in older ledgers)."""
    tokens_resumed: int = 0
    """Tokens of the group that an earlier lease generated and this one continued (``RolloutTask.partial``:
    a drained worker's prefixes or a lost worker's progress snapshot)."""


class RunDir:
    """Paths and small I/O helpers of one run folder.

    Args:
        path: the run folder (created if missing).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.created_parents: list[Path] = []
        """Folders above ``path`` that ``create`` made (``output_dir``), deepest first."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)

    @classmethod
    def existing(cls, path: str | Path) -> RunDir:
        """An existing run folder for readers (``moerl report``): creates nothing, not even ``checkpoints/``.

        Raises:
            NotADirectoryError: ``path`` is not a folder.
        """
        if not Path(path).is_dir():
            raise NotADirectoryError(f"{path} is not a folder")
        run = cls.__new__(cls)
        run.path, run.created_parents = Path(path), []
        return run

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        """A fresh folder ``<output_dir>/<name>-<UTC timestamp>`` with the resolved config written.

        Raises:
            ConfigError: ``output_dir`` is, or lies under, a file, or its folders cannot be created there (no
                such parent, no permission, a read-only file system); nothing is written.
        """
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        base = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
        for folder in (base.parent, *base.parent.parents):
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"output_dir={cfg.output_dir!r}: {folder} is a file, not a folder")
        # output_dir's folders this run creates: removed again (if still empty) with an unstarted run
        created = [p for p in (base.parent, *base.parent.parents) if not p.exists()]
        path, i = base, 1
        while True:  # mkdir, not exists(): two runs started within the same second get two folders
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                path, i = Path(f"{base}-{i}"), i + 1
            except OSError as e:  # a full disk is not this (the caller's one line names it)
                if e.errno not in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                raise ConfigError(
                    f"output_dir={cfg.output_dir!r}: cannot create {path} ({e.strerror})"
                ) from None
        run = cls(path)
        run.created_parents = created
        save_config(cfg, run.config)
        return run

    def has_started(self) -> bool:
        """Whether a trainer step left a trace: a ``metrics.jsonl`` record or a checkpoint folder."""
        return bool(read_jsonl(self.metrics)) or (
            self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        )

    def discard_if_unstarted(self) -> bool:
        """Delete the whole folder unless ``has_started()``; returns whether it was deleted.

        A run that failed before its first step (bad config, missing model, unwritable store) cannot be
        resumed (no checkpoint) and would only leave a half-written folder behind. The folders above it
        that ``create`` made go too, while empty.
        """
        if self.has_started():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.created_parents:  # e.g. runs/ made by this run alone: gone with it
            try:
                parent.rmdir()
            except OSError:  # not empty (another run's folder appeared) or already gone
                break
        return True

    @contextmanager
    def discarded_on_early_failure(self) -> Iterator[RunDir]:
        """Context for a fresh run: on any exception (Ctrl-C included) before the first trainer step,
        delete the folder (``discard_if_unstarted``), then re-raise. Never use it around a resume."""
        try:
            yield self
        except BaseException:
            self.discard_if_unstarted()
            raise

    config = property(lambda self: self.path / "config.yaml")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    ledger = property(lambda self: self.path / "ledger.jsonl")
    eval_samples = property(lambda self: self.path / "eval_samples.jsonl")  # sampled eval responses (eval.k)
    checkpoints = property(lambda self: self.path / "checkpoints")
    weights = property(lambda self: self.path / "weights")
    report = property(lambda self: self.path / "report.png")

    def checkpoint_dir(self, step: int) -> Path:
        """Folder of the full checkpoint after trainer step ``step``."""
        return self.checkpoints / f"step_{step}"

    def append_ledger(self, entries: list[LedgerEntry]) -> None:
        """Append trained-task records (one JSON line each, flushed)."""
        with open(self.ledger, "a") as f:
            for e in entries:
                f.write(
                    json.dumps(
                        {
                            "task_id": e.task_id,
                            "step": e.step,
                            "policy_version": e.policy_version,
                            "lease_token": e.lease_token,
                            "versions": list(e.versions),
                            "tokens_resumed": e.tokens_resumed,
                        }
                    )
                    + "\n"
                )
            f.flush()

    def read_ledger(self) -> list[LedgerEntry]:
        """All ledger entries in file order."""
        return [
            LedgerEntry(**{**r, "versions": tuple(r.get("versions", ()))}) for r in read_jsonl(self.ledger)
        ]

    def rewind(self, step: int) -> None:
        """Drop metrics, ledger and eval-sample records after trainer step ``step`` (before resuming from it)."""
        truncate_jsonl(self.metrics, lambda r: r.get("step", 0) <= step)
        truncate_jsonl(self.ledger, lambda r: r.get("step", 0) <= step)
        if self.eval_samples.exists():
            truncate_jsonl(self.eval_samples, lambda r: r.get("step", 0) <= step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` atomically."""
        atomic_write_text(self.summary, json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def read_summary(self, *, damaged: str = "raise") -> dict[str, Any] | None:
        """The summary, or ``None`` when the run has not finished.

        Args:
            damaged: what a ``summary.json`` that cannot be read gives: ``"raise"`` a ``SummaryError``;
                ``"warn"`` ``None`` (not finished) after one line on stderr saying so (a resume, whose
                checkpoints decide where it goes on).
        Raises:
            SummaryError: ``summary.json`` is not UTF-8 JSON of an object (the message names the file).
        """
        if not self.summary.exists():
            return None
        try:
            return _parse_summary(self.summary)
        except SummaryError as e:
            if damaged != "warn":
                raise
            print(f"moerl: {e}; resuming as a run that has not finished", file=sys.stderr)
            return None


def _parse_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SummaryError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(summary, dict):
        raise SummaryError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    return summary


class SummaryError(ValueError):
    """A run's ``summary.json`` cannot be read (damaged, e.g. edited by hand or cut by a full disk)."""


def check_resumable(run_dir: str | Path) -> None:
    """``run_dir`` is a local run folder a resume can open: it exists and holds its ``config.yaml``. Checked
    before anything is created or loaded (``RunDir()`` would create the folder; the CLI checks before torch
    loads).

    Raises:
        FileNotFoundError: the folder does not exist, is a file, or holds no ``config.yaml`` (one line
            each).
    """
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} is a file, not a run folder (name the folder to resume)")
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist (no run folder to resume)")
    if not (Path(run_dir) / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")


class RunFolderLock:
    """An exclusive lock on a run folder, held by the process that runs or resumes it, for the life of the run.

    ``flock`` on ``<folder>/run.lock`` (an empty file, created once, never written): the OS releases it when
    its holder exits, crashes or is killed, so a resume after ``kill -9`` finds it free. The holder's pid
    in the error comes from ``/proc/locks``.
    Taken before anything of the folder is read back, rewound or written; a second taker fails at once.
    The descriptor is not inherited across ``exec`` (Ray workers, spawned trainer ranks): they neither need
    nor hold it. Readers (``moerl report``) take no lock. Use as a context manager (acquire on enter,
    release on exit).

    Args:
        folder: the run folder (must exist).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._fd: int | None = None

    def acquire(self) -> RunFolderLock:
        """Take the lock without waiting; returns ``self``.

        Raises:
            RunFolderInUseError: another process (or another ``RunFolderLock`` of this one) holds it.
            FileNotFoundError: the folder does not exist.
        """
        # opened, never written: a refused resume leaves every file of the folder as it was
        fd = os.open(self.folder / LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _flock_holder(fd)
            os.close(fd)
            raise RunFolderInUseError(
                f"run folder {self.folder} is in use by another moerl process (pid {pid})"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (idempotent): closing the descriptor releases the ``flock``."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _flock_holder(fd: int) -> str:
    """The pid holding a ``flock`` on the file open as ``fd``, from Linux's ``/proc/locks`` (lines like
    ``1: FLOCK  ADVISORY  WRITE <pid> <major hex>:<minor hex>:<inode> 0 EOF``); ``"unknown"`` elsewhere."""
    st = os.fstat(fd)
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:  # not Linux
        return "unknown"
    for fields in (line.split() for line in lines):
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file_id:
            return fields[4]
    return "unknown"
