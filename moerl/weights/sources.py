"""Where a rollout worker finds newer weights: polled between scheduler steps.

``LocalWeights`` is the in-process hand-off of sync mode (the trainer ``push``es, the worker ``poll``s);
``StoreWeights`` polls a ``WeightStore`` (a Ray worker's fallback when no weights were offered through
the object store, ``moerl.runtime.ray.worker_actor``); ``CheckedWeights`` lets through only versions
whose tensors equal the engine's parameter set (names, dtypes, shapes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

import torch

from moerl.weights.store import ChecksumError, WeightStore

log = logging.getLogger(__name__)


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
    """Polls a ``WeightStore`` for a newer complete version, at most once per ``interval_s``. A version
    whose files fail their sha256 or do not match its manifest (names, shapes, dtypes) is refused: never
    switched to, logged once, counted in ``refused_versions``."""

    def __init__(self, store: WeightStore, interval_s: float = 0.5) -> None:
        self.store = store
        self.interval_s = interval_s
        self.refused_versions = 0
        self._refused: set[int] = set()
        self._next_check = 0.0

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The newest stored version's tensors if it is newer than ``version`` (checksums verified)."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.interval_s
        latest = self.store.latest()
        if latest is None or latest.version <= version or latest.version in self._refused:
            return None
        try:
            loaded = self.store.load_latest()
        except (ChecksumError, ValueError) as e:  # damaged at rest or in transit; FileNotFoundError: pruned
            log.error("weight version %d in the store refused: %s", latest.version, e)
            self._refused.add(latest.version)
            self.refused_versions += 1
            return None
        return None if loaded is None else (loaded[0].version, loaded[1])


def refused_versions_of(source) -> int:
    """Versions refused by ``source`` and by the sources behind it (a ``CheckedWeights``' ``source``,
    a receiver's ``fallback``): the sum of their ``refused_versions``; what a worker reports as
    ``weights/refused_total``."""
    total, seen = 0, set()
    while source is not None and id(source) not in seen:
        seen.add(id(source))
        total += getattr(source, "refused_versions", 0)
        source = source.source if isinstance(source, CheckedWeights) else getattr(source, "fallback", None)
    return total


def refused_version_numbers(source) -> set[int]:
    """The version numbers ``source`` and the sources behind it refused (as ``refused_versions_of`` walks
    them): a worker asked to evaluate one of them says so at once instead of waiting for it."""
    found, seen = set(), set()
    while source is not None and id(source) not in seen:
        seen.add(id(source))
        found |= set(getattr(source, "_refused", ()))
        source = source.source if isinstance(source, CheckedWeights) else getattr(source, "fallback", None)
    return found


def parameter_set(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every state-dict tensor of ``model`` (the whole model, before any
    expert sharding): what a version must match to be switched to (``CheckedWeights``)."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}


def parameter_mismatch(
    expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], tensors: Mapping[str, torch.Tensor]
) -> str | None:
    """What differs between ``tensors`` and the ``expected`` parameter set (names, dtypes, shapes), in
    one line; None when they are equal."""
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    wrong = [
        f"{n}: {tensors[n].dtype} {tuple(tensors[n].shape)} (engine {expected[n][0]} {expected[n][1]})"
        for n in sorted(expected.keys() & tensors.keys())
        if (tensors[n].dtype, tuple(tensors[n].shape)) != expected[n]
    ]
    parts = [
        f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
        f"{len(extra)} unknown (e.g. {extra[0]})" if extra else "",
        f"{len(wrong)} of another dtype or shape (e.g. {wrong[0]})" if wrong else "",
    ]
    return "; ".join(p for p in parts if p) or None


class CheckedWeights:
    """A ``WeightSource`` that passes on only versions whose tensors equal the engine's parameter set
    in names, dtypes and shapes (``parameter_set`` of the worker's model); another version is refused
    (never switched to), counted in ``refused_versions`` and logged once. Other attributes (``stats``,
    ``offer``, ``close``) are the wrapped source's."""

    def __init__(self, source, expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.source, self.expected = source, dict(expected)
        self.refused_versions = 0
        self._refused: set[int] = set()

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The wrapped source's newer version if it matches the parameter set, else None."""
        found = self.source.poll(version)
        if found is None or found[0] in self._refused:
            return None
        problem = parameter_mismatch(self.expected, found[1])
        if problem is None:
            return found
        if not self._refused:  # once: a trainer/engine mismatch repeats for every version
            log.error(
                "weight version %d refused: its tensors do not match the engine's: %s", found[0], problem
            )
        self._refused.add(found[0])
        self.refused_versions += 1
        return None

    def __getattr__(self, name: str):
        return getattr(self.source, name)
