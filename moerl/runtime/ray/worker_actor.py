"""A rollout worker in its own Ray actor process, and the proxies through which it reaches the exchange.

``RolloutWorkerActor`` builds its model, engine and task from the run config and runs the same
``RolloutWorker`` loop as sync mode. It serves four threads: the generation loop (``run``) and control
calls (``health``, ``pause``/``unpause``, ``stop``, ``notify``, ``receive_weights``, ``evaluate``: the
run's held-out eval, served by the loop between scheduler steps at the version asked). Its queue is a
``QueueProxy`` (blocking calls to the exchange actor) and its buffer a ``BufferProxy`` whose deliveries are
not waited for (``moerl.runtime.delivery``). Newer weights come through the run's weight transport
(``runtime.weight_sync``, ``moerl.weights.transport``: ``WeightOffer``s by object ref through the one
``receive_weights`` method, whatever the transport (``WorkerOffers`` is the driver's ``OfferSink`` to it),
a collective group, or a shared ring), else from polling the weight store; a failed transport loses the
worker (``crashed``).

With ``rollout.ep_size > 1`` the actor is EP rank 0 of a group (``moerl.runtime.ray.ep_group``): it starts
the follower ranks, drives them through its ``EPGroupEngine``, forwards them every weight bucket, and
still leases and delivers as the one worker of the group; a lost rank ends ``run`` as ``crashed``.

Nothing here imports Ray at module level: the handles passed in are Ray actor handles, and the module is
importable (and its proxies testable) without Ray.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moerl.allocator import keep_freed_memory
from moerl.config import RunConfig
from moerl.records import Group, Lease, LeaseSnapshot, PartialResponse, Settlement
from moerl.rollout.ep_group import EPGroupError
from moerl.rundir.storage import is_remote, local_model_folder
from moerl.runtime.buffer import BufferClosed
from moerl.runtime.build import load_policy, make_worker
from moerl.runtime.chaos import Slowdown
from moerl.runtime.counters import comm_error_counts
from moerl.runtime.drain import Drainer
from moerl.runtime.fleet import WorkerExit, WorkerHealth
from moerl.runtime.gpu import read_gpus
from moerl.runtime.notice import watcher_from_config
from moerl.runtime.ray.ep_group import EPRolloutGroup
from moerl.runtime.ray.nodes import node_address
from moerl.runtime.snapshots import SnapshotSender
from moerl.tasks import make_task
from moerl.tasks.eval import EvalResult, eval_requests, evaluate, score_completions
from moerl.tasks.tokenizer import load_run_tokenizer
from moerl.weights.collective import WeightTransportError
from moerl.weights.offer import WeightOffer
from moerl.weights.sources import (
    CheckedWeights,
    StoreWeights,
    parameter_set,
    refused_version_numbers,
    refused_versions_of,
)
from moerl.weights.store import WeightStore

IDLE_WAIT_S = (0.01, 0.1)
"""Seconds an idle worker loop (nothing in flight: the queue empty or gated, the buffer full) waits before
it asks the exchange again: 10 ms at first, doubling while nothing comes, up to 100 ms. Each ask is a
round trip to the exchange actor (CPU in both processes: at a fixed 10 ms, 100 a second). New weights
(``offer_*``), an eval, a notice and ``stop`` wake the loop at once."""


def _ray():
    import ray  # lazy: Ray is an optional dependency, needed only in async mode

    return ray


def _remote_call(handle, method: str, *args, **kwargs):
    """``ray.get(handle.<method>.remote(*args, **kwargs))``: one blocking call of an explicit actor method."""
    return _ray().get(getattr(handle, method).remote(*args, **kwargs))


REFUSED_EVAL = "weight version refused"
"""How a worker's eval error starts when it refused the version asked (``RayRollouts.evaluate``)."""


class WorkerOffers:
    """The ``OfferSink`` (``moerl.weights.offer``) of one rollout worker actor: each offer goes to its
    ``receive_weights``, not waited for. Picklable (an actor handle): travels to trainer rank 0."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __call__(self, offer: WeightOffer) -> None:
        self.handle.receive_weights.remote(offer)


class RayPending:
    """An actor call in progress (``moerl.records.Pending``): polled without blocking."""

    def __init__(self, ref) -> None:
        self.ref = ref

    def done(self) -> bool:
        """True once the call has finished (never blocks)."""
        ready, _ = _ray().wait([self.ref], timeout=0)
        return bool(ready)

    def result(self):
        """The call's result (blocks until there is one; re-raises the actor's error)."""
        return _ray().get(self.ref)


class QueueProxy:
    """The queue methods a worker needs, as blocking calls to the exchange actor. ``lease`` also tells the
    exchange the worker's weights version (``version_of()``), which its rollout gate needs."""

    def __init__(self, handle, version_of: Callable[[], int | None] = lambda: None) -> None:
        self.handle = handle
        self.version_of = version_of

    def lease(self, worker_id: str, ttl_s: float, max_tasks: int = 1) -> list[Lease]:
        """``ExchangeActor.lease`` with the worker's weights version."""
        return _remote_call(self.handle, "lease", worker_id, ttl_s, max_tasks, self.version_of())

    def heartbeat(self, target: Lease | str, ttl_s: float | None = None) -> list[Lease]:
        """``ExchangeActor.heartbeat``."""
        return _remote_call(self.handle, "heartbeat", target, ttl_s)

    def release(self, lease: Lease, *, partial: Sequence[PartialResponse] = ()) -> bool:
        """``ExchangeActor.release``."""
        return _remote_call(self.handle, "release", lease, partial=partial)

    def save_progress(self, snapshots: list[LeaseSnapshot]) -> int:
        """``ExchangeActor.save_progress`` (called on the worker's snapshot thread)."""
        return _remote_call(self.handle, "save_progress", snapshots)

    def settle(self, task_id: str, token: int, outcome: Settlement) -> bool:
        """``ExchangeActor.settle``."""
        return _remote_call(self.handle, "settle", task_id, token, outcome)


class BufferProxy:
    """The worker's ``GroupSink`` in async mode: ``put_many_async`` returns without waiting for the actor."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def put_many_async(self, groups: list[Group], *, timeout: float | None = None) -> RayPending:
        """Start ``ExchangeActor.put_many`` and return the call in progress."""
        return RayPending(self.handle.put_many.remote(groups, timeout=timeout))


@dataclass
class _EvalRequest:
    """One ``RolloutWorkerActor.evaluate`` call waiting for the loop."""

    prompts: list
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    result: EvalResult | None = None
    error: str | None = None


class RolloutWorkerActor:
    """A ``RolloutWorker`` in its own process (module docstring).

    Args:
        cfg: the run config.
        worker_id: the worker's name in the fleet.
        init_path: HF folder the model is built from (weights then come from the store), or None.
        store_url: the weight store.
        exchange: the exchange actor's handle (queue and buffer).
        notice_dir: where the worker's notice file is when ``fleet.notice_file`` is unset, or None.
        weights: the run's weight transport's ``ReceiverSpec`` (``moerl.weights.transport``); None: the
            weight store only.
        init_version: the policy version the weights at ``init_path`` are: 0 in a run that published
            its version 0 from ``init_path`` (then the store's version 0 is not loaded again: at 6.9 B
            that load is tens of seconds of the first step), -1 unknown (the first version comes from
            the store).
    """

    def __init__(
        self,
        cfg: RunConfig,
        worker_id: str,
        init_path: str | None,
        store_url: str,
        exchange,
        notice_dir: str | None = None,
        weights=None,
        init_version: int = -1,
    ):
        started = {"init": time.time()}
        torch.set_num_threads(int(os.environ.get("MOERL_ACTOR_THREADS", "1")))
        keep_freed_memory()  # no page faults on each step's activations (moerl.allocator)
        torch.manual_seed(cfg.seed)
        init_path = local_model_folder(init_path, cfg.storage.options)  # staged in the store: a local copy
        tokenizer = load_run_tokenizer(cfg, init_path)
        model = load_policy(cfg, init_path, tokenizer.vocab_size)
        started["policy_loaded"] = time.time()
        options = cfg.storage.options if is_remote(store_url) else None  # endpoint, region, profile
        store = WeightStore(store_url, keep=cfg.runtime.keep_versions, storage_options=options)
        # runtime.weight_sync: this worker's end of the transport (each EP rank opens its own), polled
        # between scheduler steps; the store is the fallback (and where the first version comes from)
        spec = None if weights is None else weights.for_worker(cfg.rollout.ep_size)
        fallback = StoreWeights(store)
        device = next(model.parameters()).device
        source = fallback if spec is None else spec.open(fallback=fallback, device=device, rank=0)
        # a version switches only if its tensors are this policy's (names, dtypes, shapes; before sharding)
        self.source = CheckedWeights(source, parameter_set(model))
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._offered = threading.Event()  # set by ``receive_weights``; the idle loop waits on it
        self._evals: list[_EvalRequest] = []  # held-out evals asked by the driver, served by ``run``
        self._evals_lock = threading.Lock()
        self.tokenizer, self.cfg = tokenizer, cfg
        # rollout.ep_size > 1: this actor is EP rank 0; its followers start in a placement group
        self.group = None
        if cfg.rollout.ep_size > 1:
            self.group = EPRolloutGroup(cfg, worker_id, init_path, store_url, weights=spec)
        self.worker = make_worker(
            cfg,
            worker_id,
            model,
            make_task(cfg.task, cfg.env, tokenizer),
            tokenizer,
            QueueProxy(exchange, version_of=self._weights_version),
            BufferProxy(exchange),
            self.source,
            version=init_version if init_path is not None and self.group is None else -1,
            pause_point=self._pause_point,
            engine=None if self.group is None else self.group.start(model),
        )
        self.snapshots = None  # fleet.snapshot_tokens: progress to the exchange, on its own thread
        if cfg.fleet.snapshot_tokens > 0 and self.worker.continues_prefixes:
            self.snapshots = SnapshotSender(
                worker_id,
                self.worker.in_flight,
                self.worker.queue.save_progress,
                every_tokens=cfg.fleet.snapshot_tokens,
                poll_s=cfg.fleet.snapshot_poll_s,
            ).start()
        self.worker.sync_weights()  # the newest published version before the first lease
        self.worker.stats.startup.update(started, ready=time.time())
        self.watcher = watcher_from_config(cfg.fleet, worker_id, default_notice_dir=notice_dir).start()
        self.drainer = Drainer(cfg.fleet.drain_grace_s, keep_partial=self.worker.keep_partial)
        self.slowdown = Slowdown.from_config(cfg.chaos, worker_id)
        self._has_gpu = cfg.model.device.startswith("cuda")
        self._node = node_address()  # the Ray node it runs on: the `node` label of its series
        self.cfg_ep_size = cfg.rollout.ep_size

    def _weights_version(self) -> int:
        return self.worker.version

    def _pause_point(self) -> None:
        if self._pause.is_set() and not self._stop.is_set():
            self.worker.settle_deliveries()  # no delivery may be in flight while paused (checkpoints)
        while self._pause.is_set() and not self._stop.is_set():
            self._paused.set()
            self._keepalive()
            time.sleep(0.01)
        self._paused.clear()

    def _keepalive(self) -> None:
        """While this loop does not step: an empty group step now and then (EP group only)."""
        if self.group is not None:
            self.group.engine.keepalive()

    def run(self) -> WorkerExit:
        """Generate until ``stop``, or until a termination notice and then drain (``moerl.runtime.drain``).
        Unfinished leases go back to the queue."""
        reason, report, error = "stopped", None, None
        idle_wait = IDLE_WAIT_S[0]
        try:
            while not self._stop.is_set() and not self.watcher.is_set():
                started = time.perf_counter()
                self.worker.step()
                self._serve_evals()
                self.slowdown.after_step(time.perf_counter() - started)  # chaos.slow_worker (off: no-op)
                if not self.worker.num_in_flight:  # queue empty or gated; a delivery may be on its way
                    woken = self._offered.wait(idle_wait)  # new weights open the staleness gate: at once
                    self._offered.clear()
                    idle_wait = IDLE_WAIT_S[0] if woken else min(2 * idle_wait, IDLE_WAIT_S[1])
                    self._keepalive()
                else:
                    idle_wait = IDLE_WAIT_S[0]
            if self.watcher.is_set() and not self._stop.is_set():
                if self.snapshots is not None:  # the newest progress first: a hard kill may beat the grace
                    self.snapshots.flush()
                reason, report = "drained", self.drainer.drain(self.worker, self.watcher.notice)
        except BufferClosed:
            pass
        except (EPGroupError, WeightTransportError) as e:  # a rank died or hung, or its weight group
            reason, error = "crashed", str(e)  # failed: the worker is lost, as if killed
        finally:
            self._paused.set()
            if self.snapshots is not None:
                self.snapshots.close()
            self._fail_evals(
                f"worker {self.worker.worker_id} ended ({reason}{': ' + error if error else ''})"
            )
            self.worker.release_all()
            if hasattr(self.source, "close"):
                self.source.close()
            if self.group is not None:
                self.group.close()
            self.watcher.stop(resend_sigterm_after_s=1.0)  # a SIGTERM notice: exit once the result is out
        return WorkerExit(self.worker.worker_id, reason, drain=report, error=error, final=self.health())

    def health(self) -> WorkerHealth:
        """Liveness answer: delivered and in-flight tokens, weights version, pid (served beside ``run``)."""
        groups = self.worker.in_flight()
        return WorkerHealth(
            tokens_delivered=self.worker.stats.tokens_generated,
            tokens_in_flight=sum(g.num_tokens for g in groups),
            groups_in_flight=len(groups),
            policy_version=self.worker.version,
            is_draining=self.watcher.is_set(),
            pid=os.getpid(),
            hostname=socket.gethostname(),
            node=self._node,
            groups_delivered=self.worker.stats.groups_put,
            gpus=read_gpus() if self._has_gpu else (),
            comm_errors=tuple(comm_error_counts().items()),
            ep_size=self.cfg_ep_size,
            rank_pids=() if self.group is None else self.group.pids,
            ep_traffic=None
            if self.group is None or self.group.engine is None
            else self.group.engine.ep_traffic,
            weights_refused=refused_versions_of(self.source),
            tokens_resumed=self.worker.stats.tokens_resumed,
            tokens_discarded=self.worker.stats.tokens_discarded,
            tokens_snapshotted=0 if self.snapshots is None else self.snapshots.tokens_covered,
            snapshot_bytes=0 if self.snapshots is None else self.snapshots.stats.bytes_sent,
            **self._sync_figures(),
        )

    def _sync_figures(self) -> dict:
        """``WorkerHealth.weight_sync_s`` / ``weight_bytes`` of the version now in the engine."""
        s, load_s = getattr(self.source, "stats", None), self.worker.stats.last_weight_load_s
        if s is None or s.last_sync_s is None or load_s is None:
            return {}
        return {"weight_sync_s": s.last_sync_s + load_s, "weight_bytes": s.last_bytes}

    def evaluate(self, prompts: list, version: int, timeout_s: float = 600.0) -> EvalResult:
        """Held-out greedy accuracy of policy ``version`` on ``prompts`` (``moerl.tasks.base.Prompt``),
        generated by this worker's engine (the whole EP group in lockstep) and scored by the task: the
        figure ``moerl.tasks.eval.evaluate`` gives for that version in process. Served by the ``run`` loop
        between scheduler steps: it waits until the engine holds ``version``, aborts the groups in flight
        (their leases go back to the queue) and generates the prompts alone (``RolloutWorker.
        generate_alone``). Engine sizes are ``rollout.max_slots`` / ``kv_token_budget`` as the driver's
        eval engine; with ``rollout.weight_dtype=fp8`` the engine's FP8 weights are evaluated.

        Raises:
            TimeoutError: not served within ``timeout_s`` seconds (the version never arrived, or the
                loop is not running).
            RuntimeError: the engine moved past ``version``, the task cannot be evaluated here (a
                multi-turn env task on an EP group), or the loop ended first.
        """
        request = _EvalRequest(list(prompts), version)
        with self._evals_lock:
            self._evals.append(request)
        self._offered.set()  # an idle loop wakes at once
        if not request.done.wait(timeout_s):
            with self._evals_lock:
                if request in self._evals:
                    self._evals.remove(request)
            raise TimeoutError(
                f"worker {self.worker.worker_id}: eval of v{version} not served in {timeout_s:.0f} s "
                f"(engine at v{self.worker.version})"
            )
        if request.error is not None:
            raise RuntimeError(request.error)
        return request.result

    def _serve_evals(self) -> None:
        """Serve the evals asked so far (``evaluate``), in the loop's thread: no weight update or
        scheduler step runs while one generates."""
        while True:
            with self._evals_lock:
                if not self._evals:
                    return
                head = self._evals[0]
                if head.version > self.worker.version and head.version not in refused_version_numbers(
                    self.source
                ):
                    return  # the version has not arrived yet: the loop goes on syncing
                request = self._evals.pop(0)
            if request.version in refused_version_numbers(self.source):  # never to arrive: say so at once
                request.error = f"{REFUSED_EVAL}: worker {self.worker.worker_id} refused v{request.version}"
                request.done.set()
                continue
            try:
                request.result = self._eval_now(request)
            except Exception as e:  # the driver gets it; an EP group's failure also ends the loop
                request.error = f"worker {self.worker.worker_id}: eval of v{request.version}: {e}"
                if isinstance(e, EPGroupError | WeightTransportError):
                    request.done.set()
                    raise
            request.done.set()

    def _eval_now(self, request: _EvalRequest) -> EvalResult:
        if self.worker.version != request.version:
            raise RuntimeError(f"the engine holds v{self.worker.version}, newer than the version asked")
        r = self.cfg.rollout
        task = self.worker.task
        if hasattr(task, "evaluate_episodes"):  # multi-turn env: a transient engine over the local model
            if self.group is not None:
                raise RuntimeError("a multi-turn env task is not evaluated on a rollout EP group")
            engine = self.worker.engine
            return evaluate(
                engine.engine.model,  # the EpisodeEngine's token engine holds the weights
                self.tokenizer,
                task,
                request.prompts,
                max_new_tokens=r.max_new_tokens,
                max_slots=r.max_slots,
                kv_token_budget=r.kv_token_budget,
            )
        sampling = self.cfg.eval  # eval.k: the sampled pass@k beside the greedy exact match
        requests = eval_requests(request.prompts, self.tokenizer, r.max_new_tokens, sampling)
        completions = self.worker.generate_alone(requests)
        return score_completions(request.prompts, completions, self.tokenizer, task, sampling)

    def _fail_evals(self, why: str) -> None:
        with self._evals_lock:
            pending, self._evals = self._evals, []
        for request in pending:
            request.error = why
            request.done.set()

    def notify(self) -> None:
        """A termination notice by actor call (when no notice file is configured)."""
        self.watcher.notify()
        self._offered.set()  # an idle loop sees it at once

    def pause(self, timeout_s: float = 30.0) -> bool:
        """Hold the loop at its next pause point (no group half-delivered); True once it is there."""
        self._pause.set()
        return self._paused.wait(timeout_s)

    def unpause(self) -> None:
        """Let a paused loop go on."""
        self._pause.clear()

    def stop(self) -> None:
        """End the loop: no new leases; a delivery blocked on a full buffer is given up."""
        self._stop.set()
        self.worker.request_stop()
        self._offered.set()  # an idle loop ends at once

    def receive_weights(self, offer: WeightOffer) -> None:
        """A piece of a newer version (a whole one or a bucket, ``WeightOffer``), whatever the transport:
        handed to this worker's receiving side (``receive``: fetched on its thread, applied between
        scheduler steps once the version is whole) and, for an EP group, forwarded to the followers."""
        self.source.receive(offer)
        if self.group is not None and offer.to_followers:  # the followers fetch the same objects themselves
            self.group.forward(offer)
        if offer.completes_version:
            self._offered.set()

    def worker_stats(self):
        """The worker's ``WorkerStats``."""
        return self.worker.stats
