"""Where a rollout worker finds newer weights: polled between scheduler steps.

``LocalWeights`` is the in-process hand-off of sync mode (the trainer ``push``es, the worker ``poll``s);
``StoreWeights`` polls a ``WeightStore`` (a Ray worker's fallback when no weights were offered through
the object store, ``moerl.runtime.ray.worker_actor``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import torch

from moerl.weights.store import WeightStore


class WeightSource(Protocol):
    """Returns ``(version, tensors)`` newer than ``version``, or None."""

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None: ...


class LocalWeights:
    """In-process weight hand-off (sync mode): the trainer ``push``es, workers ``poll``."""

    def __init__(self) -> None:
        self.version = -1
        self.tensors: Mapping[str, torch.Tensor] = {}

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Offer ``tensors`` as ``version`` (copied by the engine on its next poll)."""
        self.version, self.tensors = version, tensors

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The pushed weights if newer than ``version``."""
        return (self.version, self.tensors) if self.version > version else None


class StoreWeights:
    """Polls a ``WeightStore`` for a newer complete version, at most once per ``interval_s``."""

    def __init__(self, store: WeightStore, interval_s: float = 0.5) -> None:
        self.store = store
        self.interval_s = interval_s
        self._next_check = 0.0

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The newest stored version's tensors if it is newer than ``version`` (checksums verified)."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.interval_s
        latest = self.store.latest()
        if latest is None or latest.version <= version:
            return None
        loaded = self.store.load_latest()
        return None if loaded is None else (loaded[0].version, loaded[1])
