"""Draining a rollout worker after a termination notice, and resuming the token prefixes it hands back.

The drain (``Drainer.drain``), run by the worker's own loop once its ``NoticeWatcher`` fired::

    stop leasing
    until no group is in flight:
        release every group that cannot finish before the deadline   (projected, see below)
        one scheduler step                                           (finished groups are delivered)
    grace    = max(0, min(grace_s, the notice's seconds left at the drain's start - margin_s))
    deadline = the drain's start + grace                             (monotonic clock)

A group cannot finish when the deadline has passed, or when now + its slowest sample's tokens left x
the mean scheduler step time (exponential moving average, weight 0.2 on the newest step) is past
the deadline; before the first step is timed only a passed deadline releases. At the deadline (a
wall-clock timer) the worker's ``request_stop()`` is called if it has one, so that a delivery blocked
on a full buffer gives up. A notice without a deadline leaves ``grace_s`` as it is.

A released group's lease goes back to the queue (``TaskQueue.release``). With ``keep_partial`` the
generated prefixes ride along as ``PartialResponse``s and the next worker continues them
(``ResumePlan``); otherwise their tokens are discarded and reported as lost work.

A worker offers the drain what it needs through the ``Drainable`` protocol; ``group_progress``
builds one group's progress (``InFlightGroup``) from its finished completions and its engine's running
sequences.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from moerl.records import Lease, PartialResponse, RolloutTask
from moerl.runtime.notice import TerminationNotice

if TYPE_CHECKING:  # moerl.rollout loads torch: the fleet's bookkeeping (DrainReport) does without it
    from moerl.rollout import Completion, Request, SamplingParams


@dataclass(frozen=True, slots=True)
class InFlightGroup:
    """Progress of one group a worker is generating."""

    lease: Lease
    """The lease the group is generated under."""
    prefixes: tuple[PartialResponse, ...]
    """Generated tokens so far, one entry per sample that has any (finished samples whole)."""
    max_tokens_left: int
    """Decode steps the slowest unfinished sample may still need (max_new_tokens - its length)."""

    @property
    def num_tokens(self) -> int:
        """Response tokens generated so far over the group's samples."""
        return sum(len(p.response_ids) for p in self.prefixes)


class Drainable(Protocol):
    """What ``Drainer`` needs from a worker."""

    def stop_leasing(self) -> None:
        """Lease no new task."""

    def step(self) -> list:
        """One scheduler step; returns the groups delivered in it."""

    def in_flight(self) -> list[InFlightGroup]:
        """Progress of every group being generated."""

    def abandon(self, task_id: str, partial: Sequence[PartialResponse]) -> bool:
        """Release the group's lease to the queue (with ``partial`` prefixes) and forget the group."""


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What a drain did."""

    groups_delivered: int
    """Groups finished and delivered during the drain."""
    groups_released: int
    """Groups handed back to the queue unfinished."""
    tokens_kept: int
    """Generated tokens handed back as prefixes (``keep_partial``), to be continued by the next worker."""
    tokens_discarded: int
    """Generated tokens thrown away with released groups: lost work."""
    seconds: float
    """Wall time of the drain, in seconds."""
    grace_s: float
    """Grace period the drain had, in seconds (the configured one, shortened by the notice's deadline)."""


class Drainer:
    """Runs the drain procedure (module docstring) on a ``Drainable`` worker.

    Args:
        grace_s: seconds from the start of the drain by which everything must be delivered or released.
        keep_partial: hand generated prefixes back with released tasks (else discard them).
        margin_s: seconds kept in reserve before a deadline given by the notice itself (delivery, exit).
        clock: monotonic time in seconds; injectable in tests.
    """

    def __init__(
        self,
        grace_s: float = 90.0,
        *,
        keep_partial: bool = False,
        margin_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if grace_s < 0:
            raise ValueError(f"Drainer: grace_s={grace_s} must be >= 0 seconds")
        self.grace_s = grace_s
        self.keep_partial = keep_partial
        self.margin_s = margin_s
        self.clock = clock

    def grace_for(self, notice: TerminationNotice | None) -> float:
        """The grace period: ``grace_s``, shortened to the notice's time left minus ``margin_s``."""
        left = None if notice is None else notice.seconds_left()
        return self.grace_s if left is None else max(0.0, min(self.grace_s, left - self.margin_s))

    def drain(self, worker: Drainable, notice: TerminationNotice | None = None) -> DrainReport:
        """Stop leasing, finish what can finish before the deadline, release the rest.

        A worker that also has ``request_stop()`` gets it called at the deadline (wall clock), so that a
        delivery blocked on a full buffer gives up and releases its task instead of overrunning the grace.
        """
        start = self.clock()
        grace = self.grace_for(notice)
        deadline = start + grace
        worker.stop_leasing()
        stopper = getattr(worker, "request_stop", None)
        timer = threading.Timer(grace, stopper) if stopper is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            return self._drain(worker, start, deadline, grace)
        finally:
            if timer is not None:
                timer.cancel()

    def _drain(self, worker: Drainable, start: float, deadline: float, grace: float) -> DrainReport:
        delivered = released = kept = discarded = 0
        step_s: float | None = None  # running mean of one scheduler step, in seconds
        while True:
            groups = worker.in_flight()
            now = self.clock()
            for g in groups:
                projected = now + g.max_tokens_left * step_s if step_s is not None else now
                if now >= deadline or projected > deadline:
                    partial = g.prefixes if self.keep_partial else ()
                    if worker.abandon(g.lease.task_id, partial):
                        released += 1
                        kept += g.num_tokens if self.keep_partial else 0
                        discarded += 0 if self.keep_partial else g.num_tokens
                    else:  # the lease was already gone (expired): its tokens are lost either way
                        discarded += g.num_tokens
            if not worker.in_flight():
                break
            t0 = self.clock()
            delivered += sum(r is not None for r in worker.step())  # None: given up at the deadline
            dt = self.clock() - t0
            step_s = dt if step_s is None else 0.8 * step_s + 0.2 * dt
        return DrainReport(
            groups_delivered=delivered,
            groups_released=released,
            tokens_kept=kept,
            tokens_discarded=discarded,
            seconds=self.clock() - start,
            grace_s=grace,
        )


# ----------------------------------------------------------------------------------------------
# Progress of a RolloutWorker's groups, read from its engine


def group_progress(
    lease: Lease, finished: Sequence[Completion], running: Sequence, *, max_new_tokens: int
) -> InFlightGroup:
    """The ``InFlightGroup`` of one lease from its finished completions and its running sequences.

    Args:
        lease: the group's lease.
        finished: completions of the group's samples that already finished (``sample_index`` set).
        running: the group's running samples: engine ``Sequence``s (``sample_index``, ``token_ids``,
            ``logprobs``, ``policy_versions`` on the host) or ``PartialResponse``s (``ResumePlan.progress``);
            samples still waiting have none.
        max_new_tokens: the longest response.
    """
    prefixes = [PartialResponse(c.sample_index, c.token_ids, c.logprobs, c.policy_versions) for c in finished]
    for seq in running:
        prefix = seq if isinstance(seq, PartialResponse) else _synced_prefix(seq)
        if prefix.response_ids:
            prefixes.append(prefix)
    lengths = {p.sample_index: len(p.response_ids) for p in prefixes}
    done = {c.sample_index for c in finished}
    unfinished = [i for i in range(lease.task.num_samples) if i not in done]
    left = max((max_new_tokens - lengths.get(i, 0) for i in unfinished), default=0)
    return InFlightGroup(lease, tuple(sorted(prefixes, key=lambda p: p.sample_index)), left)


def _synced_prefix(seq) -> PartialResponse:
    """The host-synced part of an engine sequence (lists may be appended to on another thread)."""
    ids, lps, vers = list(seq.token_ids), list(seq.logprobs), list(seq.policy_versions)
    num = min(len(ids), len(lps), len(vers))
    return PartialResponse(seq.sample_index, ids[:num], lps[:num], vers[:num])


# ----------------------------------------------------------------------------------------------
# Resuming a drained group's prefixes


@dataclass(frozen=True, slots=True)
class _Part:
    sample_index: int
    prefix: PartialResponse | None


class ResumePlan:
    """How to finish a task that came back with ``partial`` prefixes: one n=1 request per unfinished sample.

    A sample whose prefix already ended (stop token, or ``max_new_tokens`` reached) is ``ready`` at once.
    Every other sample is generated by its own request whose prompt is the task's prompt followed by the
    prefix and whose ``max_new_tokens`` is what is left; ``complete`` turns that request's completion back
    into the sample's full completion (prefix + continuation, log-probs and versions concatenated, so the
    behaviour log-probs stay those of the policies that generated each token).

    Args:
        task: the task (with ``partial``).
        params: the group's sampling parameters (``n`` = group size).
        request_id: base request id; sample ``i``'s request is ``f"{request_id}/{i}"``.

    Raises:
        ValueError: a prefix longer than ``params.max_new_tokens``.
    """

    def __init__(self, task: RolloutTask, params: SamplingParams, request_id: str):
        from moerl.rollout import Request  # here, not at the top: see the TYPE_CHECKING import

        self.task = task
        self.request_id = request_id
        by_index = {p.sample_index: p for p in task.partial}
        self.ready: list[Completion] = []
        self.requests: list[Request] = []
        self._parts: dict[str, _Part] = {}
        for i in range(params.n):
            prefix = by_index.get(i)
            num = 0 if prefix is None else len(prefix.response_ids)
            if num > params.max_new_tokens:
                raise ValueError(
                    f"ResumePlan: task {task.task_id!r} sample {i} prefix has {num} tokens > "
                    f"max_new_tokens={params.max_new_tokens}"
                )
            if prefix is not None and (
                num == params.max_new_tokens or prefix.response_ids[-1] in params.stop_token_ids
            ):
                reason = "stop" if prefix.response_ids[-1] in params.stop_token_ids else "length"
                self.ready.append(self._merge(i, prefix, None, reason))
                continue
            rid = f"{request_id}/{i}"
            seed = None if params.seed is None else (params.seed + i) & ((1 << 63) - 1)
            sub = replace(params, n=1, max_new_tokens=params.max_new_tokens - num, seed=seed)
            prompt = list(task.prompt_ids) + ([] if prefix is None else list(prefix.response_ids))
            self.requests.append(Request(request_id=rid, prompt_ids=prompt, params=sub))
            self._parts[rid] = _Part(i, prefix)

    def complete(self, c: Completion) -> Completion:
        """The full completion of the sample that request ``c.request_id`` continued.

        Raises:
            KeyError: ``c`` is not a completion of one of this plan's requests.
        """
        part = self._parts[c.request_id]
        return self._merge(part.sample_index, part.prefix, c, c.finish_reason)

    def progress(self, seq) -> PartialResponse:
        """The whole prefix so far of the sample that the running engine sequence ``seq`` continues.

        Raises:
            KeyError: ``seq`` does not belong to one of this plan's requests.
        """
        part = self._parts[seq.request.request_id]
        now = _synced_prefix(seq)
        old = part.prefix or PartialResponse(part.sample_index, (), (), ())
        return PartialResponse(
            part.sample_index,
            old.response_ids + now.response_ids,
            old.response_logprobs + now.response_logprobs,
            old.policy_versions + now.policy_versions,
        )

    def _merge(
        self, index: int, prefix: PartialResponse | None, c: Completion | None, reason: str
    ) -> Completion:
        from moerl.rollout import Completion  # here, not at the top: see the TYPE_CHECKING import

        ids = list(prefix.response_ids) if prefix else []
        lps = list(prefix.response_logprobs) if prefix else []
        vers = list(prefix.policy_versions) if prefix else []
        if c is not None:
            ids, lps, vers = ids + list(c.token_ids), lps + list(c.logprobs), vers + list(c.policy_versions)
        return Completion(
            request_id=self.request_id,
            sample_index=index,
            prompt_ids=list(self.task.prompt_ids),
            token_ids=ids,
            logprobs=lps,
            finish_reason=reason,
            policy_versions=vers,
        )
