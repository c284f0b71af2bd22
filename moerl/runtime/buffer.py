"""Experience buffer: bounded, staleness-admitted, fenced hand-off of groups from rollout to trainer.

    worker --put(group)--> [staleness check] -> [filters] -> [wait for space] -> settle(token) -> deque
    trainer <--get(batch_size)-- [evict groups that aged past max_staleness] <-- deque (FIFO)

- Bounded: at most ``capacity`` groups are stored; ``put`` blocks while the buffer is full (backpressure),
  ``get`` blocks until ``batch_size`` groups are there. Both take a timeout and raise ``TimeoutError``.
- Staleness by admission (AReaL, Fu et al. 2025, "staleness-aware training"): with trainer version ``v`` and
  ``max_staleness`` ``s``, a group is admitted only if ``group.min_policy_version >= v - s``. The rule is
  checked at ``put`` and again at ``get`` / ``set_version`` for groups that aged inside the buffer. A stale
  group is dropped or its task requeued (``stale_policy``); both are counted.
- Filters (``Group -> bool``, e.g. ``has_reward_variance`` for DAPO dynamic sampling) run at ``put``.
- Fencing: every delivered group is settled through the injected ``settle(task_id, token, outcome)``
  (``TaskQueue.settle``), which atomically checks that the lease token is current and records the outcome.
  A group whose token is stale is refused and counted as ``refused_stale_token``; so the group of a task is
  stored at most once even when a slow worker delivers after its lease expired.

Thread-safe: one lock and condition variable; ``settle`` and ``requeue`` are called without the lock held,
so they may be remote (Ray) calls.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moerl.records import Group, Ready, RolloutTask, Sample, Settlement

_FORMAT = "moerl-buffer/1"


class BufferClosed(RuntimeError):
    """The buffer was closed; blocked and later ``put`` / ``get`` calls raise this."""


class PutResult(enum.StrEnum):
    """What ``ExperienceBuffer.put`` did with a group."""

    ADMITTED = "admitted"
    """Stored; the trainer will get it (unless it ages out first)."""
    FILTERED = "filtered"
    """Rejected by a filter; the task is done."""
    DROPPED_STALE = "dropped_stale"
    """Too stale and dropped; the task is done."""
    REQUEUED_STALE = "requeued_stale"
    """Too stale; the task went back to the queue."""
    REFUSED_STALE_TOKEN = "refused_stale_token"
    """The lease token is no longer current (lease expired or task settled): nothing was recorded."""


def has_reward_variance(group: Group) -> bool:
    """DAPO dynamic-sampling filter: keep a group only if its rewards are not all equal.

    A group with equal rewards has zero GRPO advantage for every sample and no gradient (DAPO, Yu et al.
    2025, Sec. 3.2, the constraint ``0 < |{o_i : is_equivalent(a, o_i)}| < G``, for a general reward).
    """
    rewards = group.rewards
    return max(rewards) > min(rewards)


@dataclass(frozen=True, slots=True)
class BufferMetrics:
    """A snapshot of an ``ExperienceBuffer``; counters are cumulative, staleness is of the last ``get``."""

    depth: int
    """Groups stored now."""
    capacity: int
    """Most groups stored at once."""
    version: int
    """Current trainer (policy) version used by the staleness rule."""
    staleness_mean: float
    """Mean of ``version - group.min_policy_version`` over the groups returned by the last ``get`` (0 before any)."""
    staleness_max: int
    """Maximum of the same over the last ``get`` (0 before any)."""
    admitted: int
    """Groups stored by ``put``."""
    delivered: int
    """Groups returned by ``get``."""
    filtered: int
    """Groups rejected by a filter at ``put``."""
    filtered_by: dict[str, int]
    """Rejections per filter (by the filter's ``__name__``)."""
    dropped_stale: int
    """Stale groups dropped, at ``put`` or after aging in the buffer."""
    requeued_stale: int
    """Stale groups whose tasks were requeued, at ``put`` or after aging in the buffer."""
    refused_stale_token: int
    """Groups refused because their lease token was no longer current."""
    put_timeouts: int
    """``put`` calls that timed out on a full buffer."""
    put_wait_s: float
    """Total seconds producers spent blocked on a full buffer."""
    get_wait_s: float
    """Total seconds spent inside ``get`` over all its calls, from entry to return: blocked waiting for
    groups, plus lock and stale-eviction time (calls that timed out or found the buffer closed count
    too; a call served at once adds about 0)."""


def _group_from_state(data: dict[str, Any]) -> Group:
    fields = dict(data)
    fields["task"] = RolloutTask(**data["task"])
    fields["samples"] = tuple(Sample(**s) for s in data["samples"])
    return Group(**fields)


class ExperienceBuffer:
    """Bounded FIFO of groups between rollout workers and the trainer; see the module docstring.

    Args:
        capacity: most groups stored at once (>= 1).
        max_staleness: s in the admission rule ``min_policy_version >= version - s`` (>= 0; 0 is on-policy).
        stale_policy: ``"drop"`` a stale group, or ``"requeue"`` its task.
        filters: predicates ``Group -> bool``; a group is kept only if all return True.
        settle: ``(task_id, lease_token, Settlement) -> bool``, normally ``TaskQueue.settle``; ``False`` means
            the token is stale and the group is refused. ``None`` accepts every group (no fencing).
        requeue: ``RolloutTask -> None``, normally ``TaskQueue.requeue``; called for admitted groups that
            aged past the staleness bound when ``stale_policy == "requeue"`` (without it they are dropped).
        initial_version: trainer version at start.

    Raises:
        ValueError: a bad argument, or ``stale_policy="requeue"`` with ``settle`` given but no ``requeue``.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_staleness: int,
        stale_policy: str = "drop",
        filters: Sequence[Callable[[Group], bool]] = (),
        settle: Callable[[str, int, Settlement], bool] | None = None,
        requeue: Callable[[RolloutTask], None] | None = None,
        initial_version: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"ExperienceBuffer: capacity={capacity} must be >= 1 group")
        if max_staleness < 0:
            raise ValueError(f"ExperienceBuffer: max_staleness={max_staleness} must be >= 0")
        if stale_policy not in ("drop", "requeue"):
            raise ValueError(f"ExperienceBuffer: stale_policy={stale_policy!r}; choose 'drop' or 'requeue'")
        if stale_policy == "requeue" and settle is not None and requeue is None:
            raise ValueError(
                "ExperienceBuffer: stale_policy='requeue' needs a requeue callable (TaskQueue.requeue)"
            )
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self._filters = tuple(filters)
        self._settle = settle
        self._requeue = requeue
        self._version = initial_version
        self._groups: collections.deque[Group] = collections.deque()
        self._num_reserved = 0  # slots held by puts that are settling outside the lock
        self._closed = False
        self._cond = threading.Condition(threading.Lock())
        self._counts = collections.Counter()
        self._filtered_by = collections.Counter()
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._last_staleness: list[int] = []

    # -- producer side -------------------------------------------------------------------------

    def put(
        self, group: Group, *, trainer_version: int | None = None, timeout: float | None = None
    ) -> PutResult:
        """Offer a group; blocks while the buffer is full.

        Args:
            group: the delivered group.
            trainer_version: newest trainer version the caller knows; the staleness rule uses the larger of
                it and the buffer's own version.
            timeout: most seconds to wait for space; ``None`` waits for ever.

        Returns:
            What happened to the group (``PutResult``). Only ``ADMITTED`` means it will be trained on.

        The lease keeps running while ``put`` blocks: keep heartbeating it (``TaskQueue.heartbeat``) from
        another thread, or a lease that expires meanwhile makes the group ``REFUSED_STALE_TOKEN``.

        Raises:
            TimeoutError: no space within ``timeout``; nothing was recorded, the lease is still held.
            BufferClosed: the buffer was closed.
        """
        with self._cond:
            self._check_open_locked()
            version = max(self._version, trainer_version if trainer_version is not None else self._version)
        if group.min_policy_version < version - self.max_staleness:
            outcome = Settlement.DROPPED_STALE if self.stale_policy == "drop" else Settlement.REQUEUED_STALE
            return self._settle_rejected(group, outcome, None)
        for keep in self._filters:
            if not keep(group):
                return self._settle_rejected(
                    group, Settlement.FILTERED, getattr(keep, "__name__", repr(keep))
                )
        self._reserve_slot(timeout)
        is_current = self._settle is None or self._settle(
            group.task_id, group.lease_token, Settlement.ADMITTED
        )
        with self._cond:
            self._num_reserved -= 1
            if is_current:
                self._groups.append(group)
                self._counts["admitted"] += 1
            else:
                self._counts["refused_stale_token"] += 1
            self._cond.notify_all()
        return PutResult.ADMITTED if is_current else PutResult.REFUSED_STALE_TOKEN

    def _settle_rejected(self, group: Group, outcome: Settlement, filter_name: str | None) -> PutResult:
        if self._settle is not None and not self._settle(group.task_id, group.lease_token, outcome):
            with self._cond:
                self._counts["refused_stale_token"] += 1
            return PutResult.REFUSED_STALE_TOKEN
        with self._cond:
            self._counts[outcome.value] += 1
            if filter_name is not None:
                self._filtered_by[filter_name] += 1
        return PutResult(outcome.value)

    def _reserve_slot(self, timeout: float | None) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        blocked = False
        with self._cond:
            try:
                while len(self._groups) + self._num_reserved >= self.capacity:
                    self._check_open_locked()
                    blocked = True
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        self._counts["put_timeouts"] += 1
                        raise TimeoutError(
                            f"ExperienceBuffer.put: buffer full ({self.capacity} groups) for {timeout} s"
                        )
                    self._cond.wait(remaining)
                self._check_open_locked()
                self._num_reserved += 1
            finally:
                if blocked:
                    self._put_wait_s += time.monotonic() - start

    def put_many(self, groups: list[Group], *, timeout: float | None = None) -> list[PutResult | None]:
        """``put`` each group in order, each waiting at most ``timeout`` for space.

        Returns:
            One ``PutResult`` per group; ``None`` for the group that timed out on a full buffer and for
            every group after it (those were not offered: their leases are still held).

        Raises:
            BufferClosed: the buffer was closed.
        """
        results: list[PutResult | None] = []
        for group in groups:
            try:
                results.append(self.put(group, timeout=timeout))
            except TimeoutError:
                return results + [None] * (len(groups) - len(results))
        return results

    def put_many_async(self, groups: list[Group], *, timeout: float | None = None) -> Ready:
        """``put_many`` as a finished ``Pending``: the delivery interface of a rollout worker
        (``moerl.runtime.delivery.GroupSink``), which an in-process buffer answers at once."""
        return Ready(self.put_many(groups, timeout=timeout))

    # -- consumer side -------------------------------------------------------------------------

    def get(self, batch_size: int, *, timeout: float | None = None) -> list[Group]:
        """Take the ``batch_size`` oldest fresh groups; blocks until there are enough.

        Groups that aged past the staleness bound are evicted first (dropped or requeued, counted).

        Raises:
            ValueError: ``batch_size`` not in [1, capacity].
            TimeoutError: fewer than ``batch_size`` fresh groups within ``timeout`` seconds (nothing taken).
            BufferClosed: the buffer was closed.
        """
        if not 1 <= batch_size <= self.capacity:
            raise ValueError(
                f"ExperienceBuffer.get: batch_size={batch_size} must be in [1, capacity={self.capacity}]"
            )
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        evicted: list[Group] = []
        try:
            with self._cond:
                while True:
                    self._check_open_locked()
                    evicted += self._evict_stale_locked()
                    if len(self._groups) >= batch_size:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"ExperienceBuffer.get: {len(self._groups)} of {batch_size} groups after {timeout} s"
                        )
                    self._cond.wait(remaining)
                batch = [self._groups.popleft() for _ in range(batch_size)]
                self._last_staleness = [self._version - g.min_policy_version for g in batch]
                self._counts["delivered"] += batch_size
                self._cond.notify_all()
                return batch
        finally:
            with self._cond:
                self._get_wait_s += time.monotonic() - start
            self._requeue_evicted(evicted)

    def set_version(self, version: int) -> None:
        """Set the trainer's current policy version; evicts groups that became too stale.

        Raises:
            ValueError: ``version`` is lower than the current one (versions never go back).
        """
        with self._cond:
            if version < self._version:
                raise ValueError(f"ExperienceBuffer.set_version: {version} < current version {self._version}")
            self._version = version
            evicted = self._evict_stale_locked()
            self._cond.notify_all()
        self._requeue_evicted(evicted)

    def _evict_stale_locked(self) -> list[Group]:
        """Remove stale groups; returns those whose tasks must be requeued (call without the lock)."""
        min_version = self._version - self.max_staleness
        stale = [g for g in self._groups if g.min_policy_version < min_version]
        if not stale:
            return []
        self._groups = collections.deque(g for g in self._groups if g.min_policy_version >= min_version)
        self._cond.notify_all()
        if self.stale_policy == "drop" or self._requeue is None:
            self._counts["dropped_stale"] += len(stale)
            return []
        self._counts["requeued_stale"] += len(stale)
        return stale

    def _requeue_evicted(self, groups: list[Group]) -> None:
        for group in groups:
            self._requeue(group.task)

    # -- state ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wake every blocked ``put`` / ``get``; they and all later calls raise ``BufferClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open_locked(self) -> None:
        if self._closed:
            raise BufferClosed("the experience buffer is closed")

    def metrics(self) -> BufferMetrics:
        """Depth, staleness of the last batch, and counters."""
        with self._cond:
            c = self._counts
            last = self._last_staleness
            return BufferMetrics(
                depth=len(self._groups),
                capacity=self.capacity,
                version=self._version,
                staleness_mean=sum(last) / len(last) if last else 0.0,
                staleness_max=max(last, default=0),
                admitted=c["admitted"],
                delivered=c["delivered"],
                filtered=c["filtered"],
                filtered_by=dict(self._filtered_by),
                dropped_stale=c["dropped_stale"],
                requeued_stale=c["requeued_stale"],
                refused_stale_token=c["refused_stale_token"],
                put_timeouts=c["put_timeouts"],
                put_wait_s=self._put_wait_s,
                get_wait_s=self._get_wait_s,
            )

    def state_dict(self) -> dict[str, Any]:
        """Stored groups, version and counters; nested dicts/lists/tuples with tensors (``routed_experts``).

        Take it while producers are paused: a ``put`` in the middle of settling is not included.
        """
        with self._cond:
            return {
                "format": _FORMAT,
                "version": self._version,
                "groups": [dataclasses.asdict(g) for g in self._groups],
                "counts": dict(self._counts),
                "filtered_by": dict(self._filtered_by),
                "last_staleness": list(self._last_staleness),
                "put_wait_s": self._put_wait_s,
                "get_wait_s": self._get_wait_s,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` into an empty buffer.

        Raises:
            ValueError: unknown format, or more saved groups than ``capacity``.
            RuntimeError: the buffer is not empty.
        """
        if state.get("format") != _FORMAT:
            raise ValueError(f"ExperienceBuffer.load_state_dict: unknown format {state.get('format')!r}")
        if len(state["groups"]) > self.capacity:
            raise ValueError(
                f"ExperienceBuffer.load_state_dict: {len(state['groups'])} groups > capacity {self.capacity}"
            )
        with self._cond:
            if self._groups or self._num_reserved:
                raise RuntimeError("ExperienceBuffer.load_state_dict needs an empty buffer")
            self._version = state["version"]
            self._groups = collections.deque(_group_from_state(g) for g in state["groups"])
            self._counts = collections.Counter(state["counts"])
            self._filtered_by = collections.Counter(state["filtered_by"])
            self._last_staleness = list(state["last_staleness"])
            self._put_wait_s = state["put_wait_s"]
            self._get_wait_s = state["get_wait_s"]
            self._cond.notify_all()
