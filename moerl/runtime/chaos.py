"""Fault injection for tests and rehearsals: SIGKILL random rollout workers, send spot-style notices,
kill the trainer. Off by default (``moerl.config.ChaosConfig``); turn it on with e.g.
``--set chaos.kill_rollout_every_s=20 --set chaos.notice_rollout_every_s=30``.

``ChaosMonkey`` only decides *when* and *whom* (seeded, with an injectable clock); the driver
applies its ``ChaosAction``s through a ``ChaosTarget`` (``moerl.runtime.ray.backend.RayWorkerBackend``
kills the worker's process with SIGKILL and writes the notice file the worker watches). The gap before
each fault is drawn uniformly in [0.5, 1.5] x the configured mean, so faults land at random points of
the workers' generation.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from moerl.atomic import atomic_write_text
from moerl.config import ChaosConfig
from moerl.runtime.notice import instance_action_document


@dataclass(frozen=True, slots=True)
class ChaosAction:
    """One injected fault."""

    kind: str
    """``"kill"`` (SIGKILL the worker's process) or ``"notice"`` (spot-style termination notice)."""
    worker_id: str
    """The victim."""
    at_s: float
    """Seconds since the monkey started."""


class ChaosTarget(Protocol):
    """Where chaos actions land."""

    def kill_hard(self, worker_id: str) -> None:
        """SIGKILL the worker's process (no drain, no goodbye)."""

    def notify(self, worker_id: str) -> None:
        """Give the worker a termination notice."""


class ChaosMonkey:
    """Schedules worker kills and notices (module docstring); a worker is a victim at most once.

    Args:
        cfg: what to inject and how often.
        clock: monotonic time in seconds; injectable in tests.
    """

    def __init__(self, cfg: ChaosConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.rng = random.Random(cfg.seed)
        self.actions: list[ChaosAction] = []
        self._start: float | None = None
        self._next: dict[str, float] = {}
        self._victims: set[str] = set()
        self._trainer_killed = False

    @property
    def is_enabled(self) -> bool:
        """Whether any fault is configured."""
        return self.cfg.is_enabled

    def _every(self, kind: str) -> float:
        return self.cfg.kill_rollout_every_s if kind == "kill" else self.cfg.notice_rollout_every_s

    def _limit(self, kind: str) -> int:
        return self.cfg.max_kills if kind == "kill" else self.cfg.max_notices

    def start(self) -> None:
        """Start the schedule now: the first fault of each kind comes ``start_after_s`` + a random gap later.
        (``due`` calls it when it first sees a candidate.)"""
        self._start = self.clock()
        for kind in ("kill", "notice"):
            if self._every(kind) > 0:
                self._next[kind] = self._start + self.cfg.start_after_s + self._gap(kind)

    def _gap(self, kind: str) -> float:
        return self._every(kind) * self.rng.uniform(0.5, 1.5)

    def due(self, candidates: Sequence[str]) -> list[ChaosAction]:
        """The faults due now, each on a random candidate (workers alive and not yet victims).

        A fault that finds no candidate waits for one. The schedule starts (``start``) at the first call
        that has candidates, so that faults are spread over the time the fleet works, not bunched up
        right after its start-up.
        """
        if self._start is None:
            if not candidates:
                return []
            self.start()
        now = self.clock()
        out = []
        for kind in sorted(self._next):
            done = sum(a.kind == kind for a in self.actions)
            limit = self._limit(kind)
            pool = sorted(set(candidates) - self._victims)
            if now < self._next[kind] or (limit and done >= limit) or not pool:
                continue
            action = ChaosAction(kind, self.rng.choice(pool), now - self._start)
            self._victims.add(action.worker_id)
            self.actions.append(action)
            out.append(action)
            self._next[kind] = now + self._gap(kind)
        return out

    def apply(self, actions: Sequence[ChaosAction], target: ChaosTarget) -> None:
        """Carry out ``actions`` on ``target``."""
        for a in actions:
            if a.kind == "kill":
                target.kill_hard(a.worker_id)
            else:
                target.notify(a.worker_id)

    def should_kill_trainer(self, step: int) -> bool:
        """True once, right after trainer step ``cfg.kill_trainer_at_step``."""
        if (
            self.cfg.kill_trainer_at_step
            and step == self.cfg.kill_trainer_at_step
            and not self._trainer_killed
        ):
            self._trainer_killed = True
            return True
        return False

    def counts(self) -> dict[str, int]:
        """Worker faults injected so far: ``{"kill": k, "notice": n}``."""
        return {
            "kill": sum(a.kind == "kill" for a in self.actions),
            "notice": sum(a.kind == "notice" for a in self.actions),
        }


def sigkill(pid: int) -> None:
    """Send SIGKILL to process ``pid`` (a process that is already gone is fine).

    Raises:
        ValueError: ``pid`` is this process or not positive (refuses to kill the driver itself).
    """
    if pid <= 0 or pid == os.getpid():
        raise ValueError(f"sigkill: refusing pid {pid} (this process is {os.getpid()})")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_notice(path: str | Path, *, seconds_from_now: float = 120.0, action: str = "terminate") -> Path:
    """Write a spot ``instance-action`` document to ``path`` atomically (temp file, then rename)."""
    path = Path(path)
    atomic_write_text(path, instance_action_document(action, seconds_from_now))
    return path
