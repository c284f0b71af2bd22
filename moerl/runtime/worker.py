"""The rollout worker: leased tasks -> groups generated at the newest weights -> scored -> buffer.

One worker drives one ``moerl.rollout.Engine``. Its loop is single-threaded and the same in every
mode: ``sync`` calls ``run(num_groups=...)`` in-process; ``async`` runs ``run()`` inside a Ray actor
(``moerl.runtime.actors``) with the queue and buffer behind actor proxies.

    loop: [new weight version? -> engine.update_weights]   (between scheduler steps only)
          lease tasks while slots are free -> engine.add_request (one request = one group of n)
          engine.step() -> completions; a group whose n samples are done is scored with the task's
          reward, put in the buffer (which settles the lease in the queue: the ack), and forgotten
          heartbeat the leases every ttl / 3

Interruption hooks for the fleet (drain on notice, requeue on loss): ``stop(drain=...)`` stops
leasing; ``release_all()`` hands unfinished leases back to the queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moerl.config import RolloutConfig
from moerl.rollout import Completion, Engine, InvalidRequestError, Request, SamplingParams
from moerl.runtime.buffer import PutResult
from moerl.runtime.drain import InFlightGroup, ResumePlan, group_progress
from moerl.runtime.types import Group, Lease, Sample, Settlement
from moerl.tasks.base import stable_hash

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Where a worker finds newer weights: returns ``(version, tensors)`` newer than ``version``, or None."""

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

    def __init__(self, store, interval_s: float = 0.5) -> None:
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


def sample_seed(run_seed: int, task_id: str, attempt: int) -> int:
    """Sampling seed of one lease of a task: the same in every run with the same seed (63 bits)."""
    return stable_hash(f"{run_seed}:{task_id}:{attempt}") & ((1 << 63) - 1)


@dataclass(slots=True)
class _InFlight:
    lease: Lease
    started: float
    completions: list[Completion] = field(default_factory=list)
    plan: ResumePlan | None = None  # continues the token prefixes a drained worker handed back
    request_ids: tuple[str, ...] = ()  # engine requests of the group (one per sample when resumed)


@dataclass(slots=True)
class WorkerStats:
    """Counters of one worker (cumulative)."""

    groups_put: int = 0
    """Groups handed to the buffer (whatever it decided)."""
    groups_admitted: int = 0
    """Groups the buffer stored for training."""
    groups_refused: int = 0
    """Groups refused because the lease was no longer current (expired, settled elsewhere)."""
    tokens_generated: int = 0
    """Response tokens generated."""
    weight_updates: int = 0
    """New weight versions loaded into the engine."""
    reward_errors: int = 0
    """Samples whose reward function raised (scored 0)."""
    invalid_tasks: int = 0
    """Tasks the engine refused (e.g. prompt + max_new_tokens longer than a slot); settled as filtered."""


class RolloutWorker:
    """Leases tasks, generates their groups with an ``Engine``, scores them, puts them in the buffer.

    Args:
        worker_id: unique name in the fleet (lease owner).
        engine: the rollout engine (owns its model copy).
        task: the task (``reward(prompt_text, response_text, answer) -> Reward``, never raises).
        decode: token ids -> text (the tokenizer's ``decode``).
        queue: a ``TaskQueue`` or a proxy with its ``lease``/``heartbeat``/``release`` methods.
        buffer: an ``ExperienceBuffer`` or a proxy with its ``put`` method.
        cfg: rollout config (group size, sampling, slots).
        stop_token_ids: generation ends after one of these (the tokenizer's eos).
        weights: where newer weights come from (polled between scheduler steps); None: never updated.
        run_seed: seeds each lease's sampling (``sample_seed``) so that sync runs are reproducible.
        lease_ttl_s: lease lifetime; leases are renewed every ttl / 3.
        put_timeout_s: most seconds one ``put`` waits on a full buffer before retrying (keeps
            heartbeats going while blocked by backpressure).
        pause_point: called between scheduler steps and between ``put`` retries, where the worker
            holds no half-delivered group; a Ray actor blocks there while paused (checkpoints).
    """

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        task,
        decode: Callable[[list[int]], str],
        queue,
        buffer,
        cfg: RolloutConfig,
        *,
        stop_token_ids: tuple[int, ...],
        weights: WeightSource | None = None,
        run_seed: int = 0,
        lease_ttl_s: float = 60.0,
        put_timeout_s: float = 1.0,
        pause_point: Callable[[], None] | None = None,
    ):
        self.worker_id = worker_id
        self.engine = engine
        self.task = task
        self.decode = decode
        self.queue = queue
        self.buffer = buffer
        self.cfg = cfg
        self.stop_token_ids = stop_token_ids
        self.weights = weights
        self.run_seed = run_seed
        self.lease_ttl_s = lease_ttl_s
        self.put_timeout_s = put_timeout_s
        self.pause_point = pause_point
        self.max_groups_in_flight = max(1, engine.num_slots // cfg.group_size)
        self.stats = WorkerStats()
        self._in_flight: dict[str, _InFlight] = {}  # request id -> group (several ids for a resumed group)
        self._delivering: list[_InFlight] = []
        self._is_leasing = True
        self._is_stopping = False
        self._last_heartbeat = time.monotonic()

    @property
    def version(self) -> int:
        """Policy version of the engine's weights."""
        return self.engine.version

    def sync_weights(self) -> bool:
        """Load newer weights into the engine if the source has them; True if it did."""
        if self.weights is None:
            return False
        found = self.weights.poll(self.engine.version)
        if found is None:
            return False
        version, tensors = found
        self.engine.update_weights(tensors, version)
        self.stats.weight_updates += 1
        return True

    def _params(self, lease: Lease) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            max_new_tokens=c.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            n=lease.task.num_samples,
            seed=sample_seed(self.run_seed, lease.task_id, lease.task.attempt),
            return_routed_experts=c.return_routed_experts,
        )

    def _lease_more(self, budget: int | None) -> None:
        """Lease tasks for free slots (at most ``budget`` more if given) and start their requests."""
        free = self.max_groups_in_flight - self.num_in_flight
        if budget is not None:
            free = min(free, budget)
        if not self._is_leasing or free <= 0:
            return
        for lease in self.queue.lease(self.worker_id, self.lease_ttl_s, free):
            request_id = f"{lease.task_id}#{lease.token}"
            job, params = _InFlight(lease, time.perf_counter()), self._params(lease)
            requests = [Request(request_id=request_id, prompt_ids=list(lease.task.prompt_ids), params=params)]
            try:
                if lease.task.partial and not self.cfg.return_routed_experts:  # R3 needs all tokens' experts
                    job.plan = ResumePlan(lease.task, params, request_id)  # continue the drained prefixes
                    job.completions += job.plan.ready
                    requests = job.plan.requests
                for request in requests:
                    self.engine.add_request(request)
            except InvalidRequestError as e:  # can never run here (e.g. prompt longer than a slot)
                log.warning(
                    "worker %s: task %s cannot be generated, settled as filtered: %s",
                    self.worker_id,
                    lease.task_id,
                    e,
                )
                self.queue.settle(lease.task_id, lease.token, Settlement.FILTERED)
                self.stats.invalid_tasks += 1
                continue
            job.request_ids = tuple(r.request_id for r in requests) or (request_id,)
            for rid in job.request_ids:
                self._in_flight[rid] = job

    def _to_sample(self, lease: Lease, c: Completion) -> Sample:
        reward = self.task.reward(lease.task.prompt_text, self.decode(c.token_ids), lease.task.answer)
        self.stats.reward_errors += int(reward.info.get("error", 0.0) > 0)
        return Sample(
            prompt_ids=lease.task.prompt_ids,
            response_ids=c.token_ids,
            response_logprobs=c.logprobs,
            loss_mask=c.loss_mask,
            finish_reason=c.finish_reason,
            policy_versions=c.policy_versions,
            reward=reward.score,
            reward_info=dict(reward.info),
            routed_experts=c.routed_experts,
        )

    def _group_of(self, job: _InFlight) -> Group:
        """Score a finished job's samples and bundle them as the lease's group."""
        job.completions.sort(key=lambda c: c.sample_index)
        samples = [self._to_sample(job.lease, c) for c in job.completions]
        self.stats.tokens_generated += sum(len(s.response_ids) for s in samples)
        return Group.from_lease(job.lease, samples, time.perf_counter() - job.started)

    def _put_many(self, groups: list[Group]) -> list[PutResult | None]:
        """Put groups in order; ``None`` for the first that timed out on a full buffer and all after it.

        A buffer behind an actor offers ``put_many`` (one round trip for the lot); a local one is
        called group by group.
        """
        if hasattr(self.buffer, "put_many"):
            return self.buffer.put_many(groups, timeout=self.put_timeout_s)
        results: list[PutResult | None] = []
        for group in groups:
            try:
                results.append(self.buffer.put(group, trainer_version=None, timeout=self.put_timeout_s))
            except TimeoutError:
                return results + [None] * (len(groups) - len(results))
        return results

    def _deliver(self, jobs: list[_InFlight]) -> list[PutResult]:
        """Score finished groups and put them in the buffer, retrying while it is full.

        Returns the buffer's decision for each delivered group. When the worker is stopping while
        the buffer is full, the undelivered groups' leases are released (their tasks go back to the
        queue).
        """
        pending = [(job, self._group_of(job)) for job in jobs]
        delivered: list[PutResult] = []
        while pending:
            outcomes = self._put_many([group for _, group in pending])
            for result in outcomes:
                if result is not None:
                    delivered.append(result)
                    self.stats.groups_put += 1
                    self.stats.groups_admitted += int(result == PutResult.ADMITTED)
                    self.stats.groups_refused += int(result == PutResult.REFUSED_STALE_TOKEN)
            pending = [item for item, result in zip(pending, outcomes, strict=True) if result is None]
            if pending:  # backpressure: keep the leases alive while waiting
                if self._is_stopping:  # nobody will drain the buffer: hand the tasks back
                    for job, _ in pending:
                        self.queue.release(job.lease)
                    break
                self.heartbeat(force=True)
                if self.pause_point is not None:
                    self.pause_point()
        return delivered

    def heartbeat(self, *, force: bool = False) -> None:
        """Renew this worker's leases every ttl / 3 (or now with ``force``)."""
        now = time.monotonic()
        if self._in_flight and (force or now - self._last_heartbeat >= self.lease_ttl_s / 3):
            self.queue.heartbeat(self.worker_id)
            self._last_heartbeat = now

    def step(self, budget: int | None = None) -> list[PutResult]:
        """One scheduler step: sync weights, lease, decode, deliver finished groups.

        Args:
            budget: most new tasks to lease in this step (None: as many as slots allow).

        Returns:
            The buffer's decision for each group delivered in this step.
        """
        if self.pause_point is not None:
            self.pause_point()
        self.sync_weights()
        self._lease_more(budget)
        if not self._in_flight:
            return []
        finished = [job for job in self._jobs() if len(job.completions) == job.lease.task.num_samples]
        for c in self.engine.step():
            job = self._in_flight.get(c.request_id)
            if job is None:  # its group was abandoned by a drain: the tokens are discarded
                continue
            job.completions.append(job.plan.complete(c) if job.plan is not None else c)
            if len(job.completions) == job.lease.task.num_samples:
                finished.append(job)
        for job in finished:
            for rid in job.request_ids:
                del self._in_flight[rid]
        self._delivering = finished  # generated, not yet in the buffer: lost if the worker dies now
        results = self._deliver(finished) if finished else []
        self._delivering = []
        self.heartbeat()
        return results

    def _jobs(self) -> list[_InFlight]:
        """Groups in flight, each once (a resumed group has one request per unfinished sample)."""
        return list({id(job): job for job in list(self._in_flight.values())}.values())

    def in_flight(self) -> list[InFlightGroup]:
        """Progress of each undelivered group (for a drain; safe from another thread: it copies lists)."""
        running: dict[str, list] = {}
        for seq in list(self.engine.scheduler.running):
            running.setdefault(seq.request.request_id, []).append(seq)
        out = [
            group_progress(job.lease, list(job.completions), [], max_new_tokens=0) for job in self._delivering
        ]
        for job in self._jobs():
            seqs = [seq for rid in job.request_ids for seq in running.get(rid, [])]
            if job.plan is not None:
                seqs = [job.plan.progress(seq) for seq in seqs]
            out.append(
                group_progress(job.lease, list(job.completions), seqs, max_new_tokens=self.cfg.max_new_tokens)
            )
        return out

    def abandon(self, task_id: str, partial=()) -> bool:
        """Release the group of ``task_id`` (with ``partial`` prefixes) and forget it (its engine requests run
        on, their completions are ignored). False: the lease was no longer current."""
        for job in self._jobs():
            if job.lease.task_id == task_id:
                for rid in job.request_ids:
                    del self._in_flight[rid]
                return bool(self.queue.release(job.lease, partial=partial))
        return False

    def run(
        self,
        num_groups: int | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
        idle_sleep_s: float = 0.05,
    ) -> int:
        """Generate until ``num_groups`` groups were delivered, or until ``should_stop()``.

        Returns:
            Groups delivered by this call.
        """
        delivered = 0
        while num_groups is None or delivered < num_groups:
            if should_stop is not None and should_stop():
                break
            budget = None if num_groups is None else num_groups - delivered - self.num_in_flight
            results = self.step(budget)
            delivered += len(results)
            if not self._in_flight and not results:
                if num_groups is not None and budget is not None and budget <= 0:
                    break
                time.sleep(idle_sleep_s)  # queue empty: nothing to do until tasks come back
        return delivered

    def stop_leasing(self) -> None:
        """Lease no new tasks (drain); in-flight groups still finish."""
        self._is_leasing = False

    def request_stop(self) -> None:
        """Stop leasing, and give up a delivery blocked on a full buffer (its task is released)."""
        self._is_leasing = False
        self._is_stopping = True

    def release_all(self) -> int:
        """Hand every unfinished lease back to the queue and abandon its work; returns how many."""
        released = sum(bool(self.queue.release(job.lease)) for job in self._jobs())
        self._in_flight.clear()
        return released

    @property
    def num_in_flight(self) -> int:
        """Groups being generated."""
        return len(self._jobs())


class LocalFleet:
    """The sync-mode runtime: queue, buffer and one worker in this process, generate-then-train.

    ``next_groups(n)`` has the worker generate exactly ``n`` groups at the current weights and takes
    them from the buffer (max_staleness 0: on-policy). The async counterpart is
    ``moerl.runtime.actors.RayFleet``; both offer ``next_groups``, ``push_weights``, ``queue_stats``,
    ``buffer_metrics``, ``state_dict``/``load_state_dict``, ``worker_stats`` and ``close``.
    """

    def __init__(self, queue, buffer, worker: RolloutWorker, weights: LocalWeights):
        self.queue, self.buffer, self.worker, self.weights = queue, buffer, worker, weights

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Generate ``n`` groups and take them from the buffer.

        Returns:
            ``(groups, generation seconds, wait seconds)``; the wait is 0 in sync mode.
        """
        start = time.perf_counter()
        while self.buffer.metrics().depth < n:
            self.worker.run(num_groups=n - self.buffer.metrics().depth)
        gen_s = time.perf_counter() - start
        return self.buffer.get(n, timeout=0), gen_s, 0.0

    def push_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand the trainer's new weights to the worker and advance the staleness clock."""
        self.weights.push(version, tensors)
        self.buffer.set_version(version)

    def queue_stats(self):
        """``TaskQueue.stats()``."""
        return self.queue.stats()

    def buffer_metrics(self):
        """``ExperienceBuffer.metrics()``."""
        return self.buffer.metrics()

    def worker_stats(self) -> list[WorkerStats]:
        """Counters of every worker."""
        return [self.worker.stats]

    def requeue(self, task) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        self.queue.requeue(task)

    def fleet_values(self, batch_groups: int) -> dict:
        """The step's ``fleet/*`` metrics: one in-process worker, never interrupted."""
        never = dict.fromkeys(
            ("fleet/interruptions", "fleet/drained", "fleet/killed", "fleet/lost_work_frac"), 0
        )
        return {**never, "fleet/workers_alive": 1, "fleet/desired_workers": 1}

    def fleet_summary(self) -> dict:
        """Fleet figures for ``summary.json`` (nothing to report in-process)."""
        return {}

    def state_dict(self) -> dict:
        """Queue and buffer state (the worker is idle between sync steps)."""
        return {"queue": self.queue.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` into the fresh queue and buffer."""
        self.queue.load_state_dict(state["queue"])
        self.buffer.load_state_dict(state["buffer"])

    def final_state(self):
        """``FleetState`` for the run's accounting."""
        from moerl.runtime.setup import FleetState

        queue_state, buffer_state = self.queue.state_dict(), self.buffer.state_dict()
        return FleetState(
            queue=self.queue.stats(),
            buffer=self.buffer.metrics(),
            queued_task_ids=tuple(t["task_id"] for t in queue_state["tasks"]),
            buffered_task_ids=tuple(g["task"]["task_id"] for g in buffer_state["groups"]),
            reward_errors=self.worker.stats.reward_errors,
        )

    def close(self) -> None:
        """Nothing to stop in-process."""
