"""The rollout worker: leased tasks -> groups generated at the newest weights -> scored -> buffer.

One worker drives one ``moerl.rollout.Engine``. Its loop is single-threaded and the same in every
mode: ``sync`` calls ``run(num_groups=...)`` in-process; ``async`` runs ``run()`` inside a Ray actor
(``moerl.runtime.ray.worker_actor``) with the queue and buffer behind actor proxies. Delivery to the
buffer is the ``Outbox``'s (``moerl.runtime.delivery``); this module leases, generates and scores.

    loop: [new weight version? -> engine.update_weights]   (between scheduler steps only)
          lease tasks in batches, up to the engine's slots plus ``rollout.lease_ahead_groups``
              -> engine.add_request (one request = one group of n; the engine queues what does not fit)
          engine.step() -> completions; a group whose n samples are done is scored with the task's
          reward and goes to the outbox
          deliver: the outbox goes to the buffer in one ``put_many`` (which settles each lease in the
              queue: the ack); at most one delivery is outstanding
          heartbeat the leases every ttl / 3

Round trips off the critical path (async mode): the buffer's ``put_many_async`` returns a
``Pending`` call (done at once for a local buffer), and the worker keeps decoding while it runs; its
outcome is collected at a later step (or waited for when there is nothing else to do), and the groups finished meanwhile go out
together in the next delivery. Leasing ahead lets one (blocking) ``lease`` call fill several groups'
slots and keeps the engine's queue non-empty, so lease round trips are rare; after a lease that got
nothing (the staleness gate is closed), a busy worker asks again only once its weights changed or
``lease_retry_s`` passed, not at every decode step. A local buffer (sync
mode) answers at once, so the sync loop keeps its order: lease, step, deliver, every step.

Interruption hooks for the fleet (drain on notice, requeue on loss): ``stop(drain=...)`` stops
leasing; ``release_all()`` hands unfinished leases back to the queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moerl.config import RolloutConfig, RunConfig
from moerl.records import Group, Lease, Sample, Settlement
from moerl.rollout import Completion, Engine, InvalidRequestError, Request, SamplingParams
from moerl.rollout.ep_group import EPGroupEngine
from moerl.rollout.stats import EngineStats
from moerl.rollout.weight_update import cancel_all, recompute_running
from moerl.runtime.buffer import BufferClosed, PutResult
from moerl.runtime.delivery import GroupSink, Outbox
from moerl.runtime.drain import InFlightGroup, ResumePlan, group_progress
from moerl.tasks.base import Reward, score_many, stable_hash
from moerl.tasks.tokenizer import Tokenizer
from moerl.weights.sources import WeightSource

log = logging.getLogger(__name__)


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

    worker_id: str = ""
    """The worker these counters belong to (``Lease.worker_id`` of its groups)."""
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
    last_weight_load_s: float | None = None
    """Seconds the last weight update took in this worker: the copy into the engine, plus the re-prefill
    (``on_weight_update=recompute``) or the release of the tasks in flight (``abort``)."""
    groups_aborted: int = 0
    """Groups released because new weights arrived (``on_weight_update=abort``)."""
    tokens_aborted: int = 0
    """Tokens discarded with them."""
    tokens_resumed: int = 0
    """Generated tokens carried into a continued sequence: the prefixes of the tasks it leased with a
    ``partial`` (a drained worker's, or a lost worker's newest progress snapshot) and continued."""
    tokens_discarded: int = 0
    """Generated tokens this worker threw away: groups aborted for new weights, released by a drain or a
    stop without their prefixes (``fleet.keep_partial`` off). A hard loss's tokens are counted by the
    fleet (``FleetManager``), which this worker cannot report."""
    kv: EngineStats | None = None
    """The engine's cache and scheduler counters after its last step (``Engine.stats``; an EP group's:
    the leader rank's); None before the first step."""
    startup: dict[str, float] = field(default_factory=dict)
    """Wall-clock times (``time.time()``, seconds) of the worker's start: ``init`` (its process entered
    the worker's constructor), ``policy_loaded``, ``ready`` (engine built, first weights synced), set by
    the Ray actor; ``first_put`` (its first groups handed to the buffer), set here."""


def _engine_stats(engine: object) -> EngineStats | None:
    """The KV-cache figures of the engine behind ``engine``: itself, an EP group's leader engine, or the
    engine an episode engine drives (whose own ``stats`` are environment figures); None if it has none."""
    ep = getattr(engine, "ep", None)  # an EP group: the leader's EPEngine
    for candidate in (ep.engine if ep is not None else None, engine, getattr(engine, "engine", None)):
        stats = getattr(candidate, "stats", None)
        if isinstance(stats, EngineStats):
            return stats
    return None


class RolloutWorker:
    """Leases tasks, generates their groups with an ``Engine``, scores them, puts them in the buffer.

    Args:
        worker_id: unique name in the fleet (lease owner).
        engine: the rollout engine (owns its model copy), or an EP group's ``EPGroupEngine``
            (``rollout.ep_size > 1``: the group leases and delivers through this one worker).
        task: the task (``reward(prompt_text, response_text, answer) -> Reward``, never raises).
        decode: token ids -> text (the tokenizer's ``decode``).
        queue: a ``TaskQueue`` or a proxy with its ``lease``/``heartbeat``/``release`` methods.
        buffer: where groups go (``GroupSink``): an ``ExperienceBuffer``, or the exchange actor's proxy
            whose ``put_many_async`` runs off the critical path.
        cfg: rollout config (group size, sampling, slots, ``lease_ahead_groups``).
        stop_token_ids: generation ends after one of these (the tokenizer's eos).
        weights: where newer weights come from (polled between scheduler steps); None: never updated.
        run_seed: seeds each lease's sampling (``sample_seed``) so that sync runs are reproducible.
        lease_ttl_s: lease lifetime; leases are renewed every ttl / 3.
        put_timeout_s: most seconds one ``put`` waits on a full buffer before retrying (keeps
            heartbeats going while blocked by backpressure).
        lease_retry_s: seconds a worker with work in flight waits before asking again after a lease
            that got nothing, unless its weights changed meanwhile (``_is_backing_off``).
        pause_point: called between scheduler steps and between ``put`` retries, where the worker
            holds no half-delivered group; a Ray actor blocks there while paused (checkpoints).
        keep_partial: a stop (``release_all``, a delivery given up) hands the generated prefixes back
            with the released tasks (``fleet.keep_partial``); else they are discarded.
    """

    continues_prefixes = True
    """Whether a task's kept prefixes (``RolloutTask.partial``) are continued rather than started over (an
    ``EpisodeWorker``'s episodes hold environment state no prefix restores: it starts over)."""

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        task,
        decode: Callable[[list[int]], str],
        queue,
        buffer: GroupSink,
        cfg: RolloutConfig,
        *,
        stop_token_ids: tuple[int, ...],
        weights: WeightSource | None = None,
        run_seed: int = 0,
        lease_ttl_s: float = 60.0,
        put_timeout_s: float = 1.0,
        lease_retry_s: float = 0.05,
        pause_point: Callable[[], None] | None = None,
        keep_partial: bool = True,
    ):
        self.worker_id = worker_id
        self.keep_partial = keep_partial and self.continues_prefixes
        self.engine = engine
        self.task = task
        self.decode = decode
        self.queue = queue
        self.cfg = cfg
        self.stop_token_ids = stop_token_ids
        self.weights = weights
        self.run_seed = run_seed
        self.lease_ttl_s = lease_ttl_s
        self.lease_retry_s = lease_retry_s
        self.pause_point = pause_point
        self.max_groups_in_flight = max(1, engine.num_slots // cfg.group_size)
        ahead = self.max_groups_in_flight if cfg.lease_ahead_groups is None else cfg.lease_ahead_groups
        self.lease_ahead_groups = ahead
        self.max_groups_held = self.max_groups_in_flight + ahead  # leased and not yet delivered
        self.stats = WorkerStats(worker_id=worker_id)
        self._in_flight: dict[str, _InFlight] = {}  # request id -> group (several ids for a resumed group)
        self._early: list[Completion] = []  # finished by a weight update's sync (recompute), not by step()
        self.outbox: Outbox[_InFlight] = Outbox(buffer, put_timeout_s)  # scored groups not yet in the buffer
        self._is_leasing = True
        self._is_stopping = False
        self._last_heartbeat = time.monotonic()
        # (weights version, monotonic time) of the last lease that got nothing; None after one that did
        self._empty_lease: tuple[int, float] | None = None

    @classmethod
    def from_run_config(
        cls,
        cfg: RunConfig,
        worker_id: str,
        engine,
        task,
        tokenizer: Tokenizer,
        queue,
        buffer: GroupSink,
        weights: WeightSource | None,
        *,
        pause_point: Callable[[], None] | None = None,
    ):
        """The worker (of this class: an ``EpisodeWorker`` too) of run config ``cfg`` over ``engine``:
        ``cfg.rollout``, the tokenizer's ``decode`` and eos as the stop token, ``cfg.seed`` as the run
        seed, ``cfg.runtime.lease_ttl_s``; the other arguments as for the constructor."""
        return cls(
            worker_id,
            engine,
            task,
            tokenizer.decode,
            queue,
            buffer,
            cfg.rollout,
            stop_token_ids=(tokenizer.eos_id,),
            weights=weights,
            run_seed=cfg.seed,
            lease_ttl_s=cfg.runtime.lease_ttl_s,
            pause_point=pause_point,
            keep_partial=cfg.fleet.keep_partial,
        )

    @property
    def version(self) -> int:
        """Policy version of the engine's weights."""
        return self.engine.version

    def sync_weights(self) -> bool:
        """Load newer weights into the engine if the source has them, then treat the sequences in flight
        as ``rollout.on_weight_update`` says (``moerl.rollout.weight_update``); True if it did."""
        if self.weights is None:
            return False
        found = self.weights.poll(self.engine.version)
        if found is None:
            return False
        t0 = time.perf_counter()
        version, tensors = found
        self.engine.update_weights(tensors, version)
        policy = self.cfg.on_weight_update
        if policy == "recompute" and self._in_flight:
            if isinstance(self.engine, EPGroupEngine):  # on every rank, in lockstep, at its next step
                self._early += self.engine.recompute_running()
            else:
                self._early += recompute_running(self.engine)
        elif policy == "abort" and self._in_flight:
            self._abort_in_flight()
        self.stats.weight_updates += 1
        self.stats.last_weight_load_s = time.perf_counter() - t0
        return True

    def _abort_in_flight(self, *, keep_prefixes: bool = False) -> None:
        """Drop the engine's requests and release their leases (requeued): ``on_weight_update=abort``
        (the prefixes are discarded: the point is fresh weights), or an eval that needs the engine alone
        (``keep_prefixes``: released with their prefixes, ``keep_partial``)."""
        groups = self._progress_of(self._jobs(), self.engine.running_by_request()) if keep_prefixes else []
        running = self.engine.running_by_request()
        aborted = 0 if keep_prefixes else sum(len(s.token_ids) for seqs in running.values() for s in seqs)
        self.stats.tokens_aborted += aborted
        self.stats.tokens_discarded += aborted
        if isinstance(self.engine, EPGroupEngine):
            self.engine.cancel_all()  # on every rank of the group, at its next step
        else:
            cancel_all(self.engine)
        self._early.clear()
        if keep_prefixes:
            for group in groups:
                self._release(group)
        else:
            for job in self._jobs():
                self.queue.release(job.lease)
        self.stats.groups_aborted += self.num_in_flight
        self._in_flight.clear()

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
        """Lease tasks for free room (at most ``budget`` more if given) and start their requests.

        Room is ``max_groups_held`` minus the groups in flight and undelivered. With lease-ahead the
        worker leases in batches: only once the engine's queue has run dry (room of at least
        ``lease_ahead_groups``), or when it holds nothing, or to finish a ``budget``.
        """
        free = self.max_groups_held - self.num_in_flight - self.num_undelivered
        wanted = max(1, self.lease_ahead_groups)
        if budget is not None:
            free, wanted = min(free, budget), min(wanted, budget)
        if not self._is_leasing or free <= 0 or (free < wanted and self.num_in_flight):
            return
        if self.num_in_flight and self._is_backing_off():
            return
        leases = self.queue.lease(self.worker_id, self.lease_ttl_s, free)
        self._empty_lease = None if leases else (self.version, time.monotonic())
        for lease in leases:
            request_id = f"{lease.task_id}#{lease.token}"
            job, params = _InFlight(lease, time.perf_counter()), self._params(lease)
            requests = [Request(request_id=request_id, prompt_ids=list(lease.task.prompt_ids), params=params)]
            try:
                # R3 needs every token's routed experts, which a prefix does not carry
                if lease.task.partial and self.continues_prefixes and not self.cfg.return_routed_experts:
                    job.plan = ResumePlan(lease.task, params, request_id)  # continue the kept prefixes
                    self.stats.tokens_resumed += sum(len(p.response_ids) for p in lease.task.partial)
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

    def _is_backing_off(self) -> bool:
        """True while a busy worker should not ask again after a lease that got nothing.

        A staleness-gated queue (``moerl.runtime.ray.exchange.rollout_allowance``) refuses a worker until a
        new policy version is published; asking at every scheduler step costs one blocking round trip per
        decode step. So after an empty lease the worker asks again once its weights changed, or after
        ``lease_retry_s`` (tasks requeued meanwhile). Only while it has work in flight: an idle worker
        asks at every step.
        """
        if self._empty_lease is None:
            return False
        version, at = self._empty_lease
        return version == self.version and time.monotonic() - at < self.lease_retry_s

    def _score(self, lease: Lease, completions: list[Completion]) -> list[Reward | None]:
        """The rewards of a group's completions: one ``Task.reward_many`` (a batched reward function gets
        the group in one call), the row's ``extra`` columns passed along."""
        t, n = lease.task, len(completions)
        texts = [self.decode(c.token_ids) for c in completions]
        return score_many(self.task, [t.prompt_text] * n, texts, [t.answer] * n, [t.extra] * n)

    def _to_sample(self, lease: Lease, c: Completion, reward: Reward | None = None) -> Sample:
        if reward is None:
            reward = self._score(lease, [c])[0]
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
        rewards = self._score(job.lease, job.completions)
        samples = [self._to_sample(job.lease, c, r) for c, r in zip(job.completions, rewards, strict=True)]
        self.stats.tokens_generated += sum(len(s.response_ids) for s in samples)
        return Group.from_lease(job.lease, samples, time.perf_counter() - job.started)

    def _collect(self, *, wait: bool) -> tuple[list[PutResult], bool]:
        """``Outbox.collect``, counted in the worker's stats."""
        delivered, is_full = self.outbox.collect(wait=wait)
        self.stats.groups_put += len(delivered)
        self.stats.groups_admitted += sum(r == PutResult.ADMITTED for r in delivered)
        self.stats.groups_refused += sum(r == PutResult.REFUSED_STALE_TOKEN for r in delivered)
        return delivered, is_full

    def _must_wait(self) -> bool:
        """Nothing to decode and no room to lease meanwhile (or not leasing any more)."""
        return not self._in_flight and (not self._is_leasing or self.num_undelivered >= self.max_groups_held)

    def _deliver(self) -> list[PutResult]:
        """Collect the outstanding delivery, then send the outbox (one delivery at a time).

        Returns as soon as a delivery is outstanding, unless the worker has nothing else to do
        (``_must_wait``): then it waits until the outbox is in the buffer. A local buffer answers at
        once, so there every group is delivered before this returns.

        Returns:
            The buffer's decision for each group delivered by this call. While the buffer is full the
            leases are kept alive by heartbeats; when the worker is stopping, the undelivered groups'
            leases are released instead (their tasks go back to the queue).
        """
        delivered: list[PutResult] = []
        while True:
            done, is_full = self._collect(wait=self._must_wait())
            delivered += done
            if is_full:  # backpressure
                if self._is_stopping:  # nobody will drain the buffer: hand the tasks back
                    waiting = self.outbox.take_waiting()
                    progress = {g.lease.token: g for g in self._progress_of(waiting, running={})}
                    for job in waiting:
                        self._release(progress[job.lease.token])
                    return delivered
                self.heartbeat(force=True)
                if self.pause_point is not None:
                    self.pause_point()
            if not self.outbox.send():  # one delivery at a time
                return delivered
            self.stats.startup.setdefault("first_put", time.time())  # groups on their way to the buffer

    def settle_deliveries(self) -> list[PutResult]:
        """Wait for the outstanding delivery, without sending more: afterwards no group is half-delivered
        (the buffer holds it, or the worker does). For pauses (checkpoints) and shutdown."""
        return self._collect(wait=True)[0]

    def heartbeat(self, *, force: bool = False) -> None:
        """Renew this worker's leases every ttl / 3 (or now with ``force``)."""
        now = time.monotonic()
        held = self._in_flight or self.num_undelivered  # undelivered groups' leases must live on too
        if held and (force or now - self._last_heartbeat >= self.lease_ttl_s / 3):
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
        if self._in_flight:
            finished = [job for job in self._jobs() if len(job.completions) == job.lease.task.num_samples]
            early, self._early = self._early, []
            done = early + self.engine.step()
            self.stats.kv = _engine_stats(self.engine)
            for c in done:
                job = self._in_flight.get(c.request_id)
                if job is None:  # its group was abandoned by a drain: the tokens are discarded
                    continue
                job.completions.append(job.plan.complete(c) if job.plan is not None else c)
                if len(job.completions) == job.lease.task.num_samples:
                    finished.append(job)
            for job in finished:
                for rid in job.request_ids:
                    del self._in_flight[rid]
            # generated, not yet in the buffer: lost if the worker dies now (their leases expire)
            self.outbox.add([(job, self._group_of(job)) for job in finished])
        results = self._deliver() if self.num_undelivered else []
        self.heartbeat()
        return results

    def _jobs(self) -> list[_InFlight]:
        """Groups in flight, each once (a resumed group has one request per unfinished sample)."""
        return list({id(job): job for job in list(self._in_flight.values())}.values())

    def in_flight(self) -> list[InFlightGroup]:
        """Progress of each undelivered group (for a drain and the progress snapshots; safe from another
        thread: it copies lists)."""
        out = self._progress_of(self.outbox.jobs(), running={})
        return out + self._progress_of(self._jobs(), self.engine.running_by_request())

    def _progress_of(self, jobs: list[_InFlight], running: dict) -> list[InFlightGroup]:
        """``group_progress`` of ``jobs``: finished completions, the engine's ``running`` sequences, and a
        resumed sample still queued in the engine (not running) at its kept prefix."""
        out = []
        for job in jobs:
            seqs = [seq for rid in job.request_ids for seq in running.get(rid, [])]
            if job.plan is not None:
                seqs = [job.plan.progress(seq) for seq in seqs]
            finished = list(job.completions)
            if job.plan is not None:  # queued continuations keep their prefix in a snapshot or release
                seen = {p.sample_index for p in seqs} | {c.sample_index for c in finished}
                seqs += [p for p in job.lease.task.partial if p.sample_index not in seen]
            max_new = self.cfg.max_new_tokens if len(finished) < job.lease.task.num_samples else 0
            out.append(group_progress(job.lease, finished, seqs, max_new_tokens=max_new))
        return out

    def _release(self, group: InFlightGroup) -> bool:
        """Release ``group``'s lease with its prefixes (``keep_partial``), else count them discarded."""
        if not self.keep_partial:
            self.stats.tokens_discarded += group.num_tokens
        return bool(self.queue.release(group.lease, partial=group.prefixes if self.keep_partial else ()))

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
        """Hand every unfinished or undelivered lease back to the queue and abandon its work; returns
        how many. The outstanding delivery is waited for first (its groups may be in the buffer now)."""
        try:
            self.settle_deliveries()
        except BufferClosed:  # the run is over: its groups are released below
            pass
        groups = self._progress_of(self._jobs(), self.engine.running_by_request())
        groups += self._progress_of(self.outbox.take_waiting(), running={})
        released = sum(self._release(g) for g in groups)
        self._in_flight.clear()
        return released

    def generate_alone(self, requests: list[Request]) -> list[Completion]:
        """Run ``requests`` to completion on this worker's engine with nothing else in it (a held-out
        eval): the groups in flight are aborted first (engine requests dropped on every EP rank, their
        leases released to the queue with their prefixes under ``keep_partial``, ``stats.groups_aborted``), so the engine generates exactly these,
        as a fresh one would. Returns their completions (any order). Weights are not synced meanwhile.

        Raises:
            InvalidRequestError: a request the engine refuses (prompt too long for its budget).
        """
        self.settle_deliveries()  # finished groups go to the buffer; only unfinished ones are aborted
        if self._in_flight:
            self._abort_in_flight(keep_prefixes=True)
        wanted = {r.request_id for r in requests}
        for request in requests:
            self.engine.add_request(request)
        done: list[Completion] = []
        while len(done) < sum(r.params.n for r in requests):  # n samples each (a sampled eval: eval.n)
            done += [c for c in self.engine.step() if c.request_id in wanted]
        return done

    @property
    def num_in_flight(self) -> int:
        """Groups being generated (running or queued in the engine)."""
        return len(self._jobs())

    @property
    def num_undelivered(self) -> int:
        """Finished groups not yet in the buffer."""
        return len(self.outbox)
