"""The run folder: where a training run writes everything a person or a resumed run reads back.

Layout (``runs/<name>-<timestamp>/``)::

    config.yaml        resolved RunConfig
    metrics.jsonl      one record per trainer step (schema: moerl.telemetry.metrics.METRIC_KEYS)
    summary.json       final figures and exactly-once task accounting
    ledger.jsonl       one line per trained task: {"task_id", "step", "policy_version", "lease_token"}
    checkpoints/       step_N/ full run state (moerl.runtime.checkpoint: save/load/latest_checkpoint)
    weights/           published weight versions (the default WeightStore)
    report.png         curves against step and wall time

Every file that another process may read is written atomically (temp file, then ``os.replace``);
append-only JSONL files are flushed per line and cut back to a step on resume.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moerl.atomic import atomic_write_text
from moerl.config import RunConfig, save_config


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


class RunDir:
    """Paths and small I/O helpers of one run folder.

    Args:
        path: the run folder (created if missing).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
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
        run.path = Path(path)
        return run

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        """A fresh folder ``<output_dir>/<name>-<UTC timestamp>`` with the resolved config written."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        base = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
        path, i = base, 1
        while path.exists():  # two runs started within the same second
            path, i = Path(f"{base}-{i}"), i + 1
        run = cls(path)
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
        resumed (no checkpoint) and would only leave a half-written folder behind.
        """
        if self.has_started():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
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
                        }
                    )
                    + "\n"
                )
            f.flush()

    def read_ledger(self) -> list[LedgerEntry]:
        """All ledger entries in file order."""
        return [LedgerEntry(**r) for r in read_jsonl(self.ledger)]

    def rewind(self, step: int) -> None:
        """Drop metrics and ledger records after trainer step ``step`` (before resuming from it)."""
        truncate_jsonl(self.metrics, lambda r: r.get("step", 0) <= step)
        truncate_jsonl(self.ledger, lambda r: r.get("step", 0) <= step)

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
