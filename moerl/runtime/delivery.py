"""A rollout worker's outbox: scored groups on their way to the experience buffer.

The worker hands each finished, scored group to its ``Outbox``; the outbox sends what it holds to the
buffer in one ``put_many_async`` call, at most one delivery outstanding. Both buffers a worker talks to
implement ``GroupSink``: the local ``ExperienceBuffer`` (the call is done when it returns) and the
exchange actor's proxy in async mode (``moerl.runtime.ray.worker_actor``: the call runs while the worker
keeps decoding). Groups that did not fit in a full buffer come back to the front of the outbox.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from moerl.records import Group, Pending
from moerl.runtime.buffer import PutResult

Job = TypeVar("Job")


class GroupSink(Protocol):
    """Where a worker delivers groups: ``put_many_async(groups, timeout=...)`` returns a ``Pending``
    whose result lists the buffer's decision per group in order, ``None`` from the first group that
    timed out on a full buffer on (``ExperienceBuffer.put_many``)."""

    def put_many_async(self, groups: list[Group], *, timeout: float | None = None) -> Pending: ...


class Outbox(Generic[Job]):
    """Scored groups not yet in the buffer, each with the worker's job that produced it.

    Args:
        sink: the buffer (or its proxy).
        put_timeout_s: most seconds one delivery waits on a full buffer before it gives groups back.
    """

    def __init__(self, sink: GroupSink, put_timeout_s: float) -> None:
        self.sink = sink
        self.put_timeout_s = put_timeout_s
        self._waiting: list[tuple[Job, Group]] = []  # scored, not yet sent (or sent back: buffer full)
        self._sending: tuple[Pending, list[tuple[Job, Group]]] | None = None  # the outstanding delivery

    def add(self, items: list[tuple[Job, Group]]) -> None:
        """Queue ``(job, group)`` pairs for the next delivery."""
        self._waiting += items

    def send(self) -> bool:
        """Start a delivery of everything waiting, unless one is outstanding or nothing waits; True if
        one started."""
        if self._sending is not None or not self._waiting:
            return False
        items, self._waiting = self._waiting, []
        groups = [group for _, group in items]
        self._sending = (self.sink.put_many_async(groups, timeout=self.put_timeout_s), items)
        return True

    def collect(self, *, wait: bool) -> tuple[list[PutResult], bool]:
        """Record the outstanding delivery's outcome if it is done (or wait for it).

        Returns:
            ``(decisions of the delivered groups, whether the buffer was full)``; groups that did not
            fit go back to the front of the outbox. If the call raised (e.g. ``BufferClosed``), all its
            groups go back to the outbox and the error propagates.
        """
        if self._sending is None or not (wait or self._sending[0].done()):
            return [], False
        pending, items = self._sending
        self._sending = None
        try:
            outcomes = pending.result()
        except BaseException:
            self._waiting[:0] = items
            raise
        delivered, retry = [], []
        for item, result in zip(items, outcomes, strict=True):
            if result is None:
                retry.append(item)
            else:
                delivered.append(result)
        self._waiting[:0] = retry
        return delivered, bool(retry)

    def take_waiting(self) -> list[Job]:
        """Empty the outbox (not the outstanding delivery); returns the jobs of the groups taken out."""
        jobs = [job for job, _ in self._waiting]
        self._waiting = []
        return jobs

    def jobs(self) -> list[Job]:
        """Jobs of every undelivered group, waiting or being sent (copies: safe from another thread)."""
        sending = self._sending
        return [job for job, _ in list(self._waiting) + (list(sending[1]) if sending else [])]

    def __len__(self) -> int:
        """Undelivered groups, waiting or being sent."""
        return len(self._waiting) + (len(self._sending[1]) if self._sending else 0)
