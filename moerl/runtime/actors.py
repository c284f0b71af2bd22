"""Async mode on Ray: the queue, the buffer and N rollout workers as actors; the trainer in the driver.

    driver (Trainer) --get--> ExchangeActor [ExperienceBuffer --settle/requeue--> TaskQueue]
          |                         ^ put                                   ^ lease / heartbeat
          |                         +----------- RolloutWorkerActor x N ----+
          +--publish--> WeightStore (source of truth) <--poll-- workers
          +--ray.put(weights)--> object store --offer--> workers (faster path, same versions)

Resources declared per actor (a cluster maps them onto node groups):

- ``ExchangeActor`` (``moerl.runtime.exchange``): the ``TaskQueue`` and the ``ExperienceBuffer`` in
  one lightweight actor (``num_cpus=0``, I/O bound), so that settling a delivered group in the queue
  is a local call. Threaded (``max_concurrency``) because producers block in ``put`` on a full buffer
  (backpressure) while the trainer's ``get`` must still run; both classes are thread-safe. Its
  ``lease`` is gated (``rollout_allowance``): no rollout starts that would arrive too stale to train.

Round trips kept off the critical paths: a worker's deliveries (``put_many``) are not waited for
(``_BufferProxy.put_many_async``; at most one outstanding, the groups finished meanwhile go in the
next), its leases carry its weights version; the trainer's version travels with its ``get`` (so
``set_version`` is not waited for), and the per-step queue/buffer metrics are one round trip.
- ``RolloutWorkerActor``: ``num_cpus=1``, ``num_gpus=1`` when ``model.device`` is CUDA, plus the
  custom resource ``rollout`` (0.001) when the cluster defines it (``ray start --resources
  '{"rollout": 8}'`` on rollout nodes). Three threads: the generation loop and control calls
  (``pause``/``stop``/``offer_weights``/``health``). Workers are started, watched, replaced and
  drained by a ``FleetManager`` (``moerl.runtime.fleet``, see ``FLEET.md``). ``torch.set_num_threads(1)`` unless ``MOERL_ACTOR_THREADS``
  says otherwise, so N workers and the trainer share a small machine without oversubscription.
- The trainer runs in the driver (custom resource ``train`` is not needed).

Without ``--ray-address`` a local Ray instance is started with ``num_cpus = max(cores, N)``.
Methods that return object refs are prefixed ``async_``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Mapping

import torch

from moerl.config import ConfigError, RunConfig
from moerl.runtime.allocator import keep_freed_memory
from moerl.runtime.buffer import BufferClosed
from moerl.runtime.chaos import ChaosMonkey
from moerl.runtime.drain import Drainer
from moerl.runtime.exchange import ExchangeActorImpl
from moerl.runtime.fleet import EXPIRE_NOW_TTL_S, FleetManager, WorkerExit, WorkerHealth
from moerl.runtime.fleet_ray import RayWorkerBackend
from moerl.runtime.notice import notice_file_for, watcher_from_config
from moerl.runtime.types import Group
from moerl.runtime.weights import pack_weights, unpack_weights


def _remote_call(handle, method: str, *args, **kwargs):
    return __import__("ray").get(getattr(handle, method).remote(*args, **kwargs))


def _set_threads() -> None:
    torch.set_num_threads(int(os.environ.get("MOERL_ACTOR_THREADS", "1")))
    keep_freed_memory()  # no page faults on each step's activations (moerl.runtime.allocator)


class _RayPending:
    """An actor call in progress (``moerl.runtime.worker.Pending``): polled without blocking."""

    def __init__(self, ref):
        self.ref = ref

    def done(self) -> bool:
        ready, _ = __import__("ray").wait([self.ref], timeout=0)
        return bool(ready)

    def result(self):
        return __import__("ray").get(self.ref)


class _QueueProxy:
    """The queue methods a worker needs, as blocking calls to the queue actor. ``lease`` also tells the
    exchange the worker's weights version (``version_of()``), which its rollout gate needs."""

    def __init__(self, handle, version_of=lambda: None):
        self.handle = handle
        self.version_of = version_of

    def lease(self, worker_id, ttl_s, max_tasks=1):
        return _remote_call(self.handle, "lease", worker_id, ttl_s, max_tasks, self.version_of())

    def heartbeat(self, target, ttl_s=None):
        return _remote_call(self.handle, "call", "heartbeat", target, ttl_s)

    def release(self, lease, *, partial=()):
        return _remote_call(self.handle, "call", "release", lease, partial=partial)

    def settle(self, task_id, token, outcome):
        return _remote_call(self.handle, "call", "settle", task_id, token, outcome)


class _BufferProxy:
    """The buffer methods a worker needs; ``put_many_async`` returns without waiting for the actor."""

    def __init__(self, handle):
        self.handle = handle

    def put_many_async(self, groups: list[Group], timeout=None) -> _RayPending:
        return _RayPending(self.handle.put_many.remote(groups, timeout=timeout))


class _OfferedWeights:
    """Weights offered through the object store, falling back to polling the store."""

    def __init__(self, store_source):
        self.store_source = store_source
        self.offer: tuple[int, object] | None = None
        self.lock = threading.Lock()

    def poll(self, version: int):
        with self.lock:
            offer, self.offer = self.offer, None
        if offer is not None and offer[0] > version:
            return offer[0], unpack_weights(__import__("ray").get(offer[1]))
        return self.store_source.poll(version)


class RolloutWorkerActorImpl:
    """A ``RolloutWorker`` in its own process: builds its model, engine and task from the config."""

    def __init__(
        self,
        cfg: RunConfig,
        worker_id: str,
        init_path: str | None,
        store_url: str,
        queue_handle,
        buffer_handle,
    ):
        _set_threads()
        from moerl.runtime.setup import load_policy, make_worker
        from moerl.runtime.weights import WeightStore
        from moerl.runtime.worker_local import StoreWeights
        from moerl.tasks import load_tokenizer, make_task
        from moerl.tasks.tokenizer import tokenizer_path_for

        torch.manual_seed(cfg.seed)
        tokenizer = load_tokenizer(tokenizer_path_for(cfg.task.tokenizer, init_path or cfg.model.path))
        model = load_policy(cfg, init_path, tokenizer.vocab_size)
        self.weights = _OfferedWeights(StoreWeights(WeightStore(store_url, keep=cfg.runtime.keep_versions)))
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._offered = threading.Event()  # set by ``offer_weights``; the idle loop waits on it
        self.worker = make_worker(
            cfg,
            worker_id,
            model,
            make_task(cfg.task, cfg.env),
            tokenizer,
            queue_proxy := _QueueProxy(queue_handle),
            _BufferProxy(buffer_handle),
            self.weights,
            version=-1,
        )
        self.worker.pause_point = self._pause_point
        queue_proxy.version_of = lambda: self.worker.version
        self.worker.sync_weights()  # the newest published version before the first lease
        self.watcher = watcher_from_config(cfg.fleet, worker_id).start()  # termination notices
        self.drainer = Drainer(cfg.fleet.drain_grace_s, keep_partial=cfg.fleet.keep_partial)

    def _pause_point(self) -> None:
        if self._pause.is_set() and not self._stop.is_set():
            self.worker.settle_deliveries()  # no delivery may be in flight while paused (checkpoints)
        while self._pause.is_set() and not self._stop.is_set():
            self._paused.set()
            time.sleep(0.01)
        self._paused.clear()

    def run(self) -> WorkerExit:
        """Generate until ``stop``, or until a termination notice and then drain (``moerl.runtime.drain``).
        Unfinished leases go back to the queue."""
        reason, report = "stopped", None
        try:
            while not self._stop.is_set() and not self.watcher.is_set():
                self.worker.step()
                if not self.worker.num_in_flight:  # queue empty or gated; a delivery may be on its way
                    self._offered.wait(0.01)  # new weights open the staleness gate: wake at once
                    self._offered.clear()
            if self.watcher.is_set() and not self._stop.is_set():
                reason, report = "drained", self.drainer.drain(self.worker, self.watcher.notice)
        except BufferClosed:
            pass
        finally:
            self._paused.set()
            self.worker.release_all()
            self.watcher.stop(resend_sigterm_after_s=1.0)  # a SIGTERM notice: exit once the result is out
        return WorkerExit(self.worker.worker_id, reason, drain=report, final=self.health())

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
        )

    def notify(self) -> None:
        """A termination notice by actor call (when no notice file is configured)."""
        self.watcher.notify()

    def pause(self, timeout_s: float = 30.0) -> bool:
        """Hold the loop at its next pause point (no group half-delivered); True once it is there."""
        self._pause.set()
        return self._paused.wait(timeout_s)

    def unpause(self) -> None:
        self._pause.clear()

    def stop(self) -> None:
        self._stop.set()
        self.worker.request_stop()

    def offer_weights(self, version: int, refs: list) -> None:
        """Weights of ``version`` in the object store (``refs[0]``), applied between scheduler steps."""
        with self.weights.lock:
            self.weights.offer = (version, refs[0])
        self._offered.set()

    def stats(self):
        return self.worker.stats


def _labels(name: str) -> dict[str, float]:
    """Custom resource ``name`` if the cluster defines it (node-group placement), else none."""
    import ray

    return {name: 0.001} if name in ray.cluster_resources() else {}


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a Ray address whose head cannot be reached (``ray.init`` would retry for minutes).

    ``host:port`` and ``ray://host:port`` are probed with one TCP connection; other forms (``auto``,
    ``local``) are left to Ray.

    Raises:
        ConfigError: the address is malformed or nothing accepts a connection there within ``timeout_s``.
    """
    target = address.removeprefix("ray://")
    if address in ("auto", "local") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"runtime.ray_address={address!r}: expected host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"runtime.ray_address={address!r}: cannot reach {host}:{port} ({e})") from e


def _init_ray(cfg: RunConfig) -> None:
    """Connect to ``runtime.ray_address`` or start a local Ray instance, keeping this process's SIGTERM
    handler: ``ray.init`` installs its own (``sys.exit``), which would bypass the controller's (a SIGTERM
    stops a run like Ctrl-C)."""
    import ray

    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if is_main else None
    if cfg.runtime.ray_address:
        ray.init(address=cfg.runtime.ray_address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, cfg.rollout.num_workers),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        # the trainer (this process) gets the cores the local workers do not use
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - cfg.rollout.num_workers))
    if is_main and previous is not None:
        signal.signal(signal.SIGTERM, previous)


class RayFleet:
    """The async-mode fleet (see the module docstring); same interface as ``LocalFleet``.

    Args:
        cfg: the run config (``rollout.num_workers`` workers; ``runtime.ray_address``).
        init_path: HF folder the workers build their model from (weights then come from the store).
        store_url: the weight store; version ``version`` must already be published.
        version: the trainer's current policy version.
        parts: checkpoint parts with ``queue`` and ``buffer`` state to restore, or None.
    """

    def __init__(
        self, cfg: RunConfig, init_path: str | None, store_url: str, *, version: int, parts: dict | None
    ):
        import ray

        from moerl.tasks.tokenizer import tokenizer_path_for

        if not ray.is_initialized():
            _init_ray(cfg)
        tok_path = tokenizer_path_for(cfg.task.tokenizer, init_path or cfg.model.path)
        exchange_cls = ray.remote(num_cpus=0, max_concurrency=cfg.rollout.num_workers * 2 + 16)(
            ExchangeActorImpl
        )
        self.buffer = exchange_cls.remote(cfg, tok_path, version)
        self.queue = self.buffer  # one actor serves both (queue methods via ``call``)
        if parts is not None:
            ray.get(self.queue.call.remote("load_state_dict", parts["queue"]))
            ray.get(self.buffer.load_state_dict.remote(parts["buffer"]))
        gpus = 1 if cfg.model.device.startswith("cuda") else 0
        worker_cls = ray.remote(num_cpus=1, num_gpus=gpus, max_concurrency=3, resources=_labels("rollout"))(
            RolloutWorkerActorImpl
        )
        self.cfg = cfg
        self.backend = RayWorkerBackend(
            lambda wid: worker_cls.remote(cfg, wid, init_path, store_url, self.queue, self.buffer),
            notice_path=lambda wid: notice_file_for(cfg.fleet, wid, None),
        )
        self.manager = FleetManager.from_config(cfg.fleet, cfg.rollout.num_workers, self.backend)
        self.chaos = ChaosMonkey(cfg.chaos)
        self.manager.start()
        self._last_batch = time.perf_counter()
        self._next_check = 0.0
        self._version = version  # the trainer's policy version, sent with each batch request
        self._snapshot = None  # (QueueStats, BufferMetrics) of the last queue_stats() this step

    def check_fleet(self, *, force: bool = False) -> None:
        """Every ``fleet.check_every_s``: liveness and replacements (``FleetManager.check``), chaos faults.

        Raises:
            RuntimeError: a worker's loop raised (its error), or no rollout worker is left.
        """
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + self.cfg.fleet.check_every_s
        for e in self.manager.check():
            if e.reason == "crashed":  # expire its leases now instead of after lease_ttl_s
                self.queue.call.remote("heartbeat", e.worker_id, EXPIRE_NOW_TTL_S)
        if self.chaos.is_enabled:
            self.chaos.apply(self.chaos.due(self.manager.busy_ids()), self.backend)
        if not self.manager.active_ids():
            raise RuntimeError("no rollout worker is left (fleet.min_workers=0 and every worker is gone)")

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Take ``n`` groups from the buffer, waiting while the fleet fills it.

        Returns:
            ``(groups, seconds since the previous batch, seconds waited)``.
        """
        import ray

        start = time.perf_counter()
        while True:
            self.check_fleet()
            try:
                groups = ray.get(
                    self.buffer.get.remote(n, timeout=self.cfg.fleet.check_every_s, version=self._version)
                )
                break
            except TimeoutError:  # Ray re-raises the actor's TimeoutError as a subclass of it
                pass
        now = time.perf_counter()
        gen_s, self._last_batch = now - self._last_batch, now
        self._snapshot = None
        return groups, gen_s, now - start

    def push_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Advance the staleness clock and offer the new weights via the object store.

        The version goes to the exchange without waiting (workers' admissions see it a round trip
        later); the next ``next_groups`` carries it too, so the trainer's batch is always taken at it.
        """
        import ray

        self._version, self._snapshot = version, None
        self.buffer.set_version.remote(version)
        ref = ray.put(pack_weights(tensors))  # one flat buffer: the fast out-of-band serialization
        for w in self.backend.alive_handles():
            w.offer_weights.remote(version, [ref])

    def requeue(self, task) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        self._snapshot = None
        __import__("ray").get(self.queue.call.remote("requeue", task))

    def fleet_values(self, batch_groups: int) -> dict:
        """The step's ``fleet/*`` metrics, with the scaling hint from queue and buffer depth."""
        if self._snapshot is None:
            self.queue_stats()
        pending, depth = self._snapshot[0].pending, self._snapshot[1].depth
        self.manager.scaling_hint(queue_pending=pending, buffer_depth=depth, batch_groups=batch_groups)
        return self.manager.metrics().as_metrics()

    def fleet_summary(self) -> dict:
        """Fleet figures for ``summary.json``."""
        m, q = self.manager.metrics(), self.queue_stats()
        return {
            "interruptions": m.interruptions,
            "drained": m.drained,
            "killed": m.killed,
            "spawned": m.spawned,
            "replaced": m.replaced,
            "time_to_replace_s": m.time_to_replace_s,
            "replace_times_s": m.replace_times_s,
            "lost_work_frac": m.lost_work_frac,
            "tokens_generated": m.tokens_generated,
            "tokens_discarded": m.tokens_discarded,
            "tasks_released": q.released,
            "tasks_expired": q.expired,
            "tasks_requeued_stale": q.requeued_stale,
            "chaos": self.chaos.counts(),
        }

    def scale_to(self, num_workers: int) -> int:
        """Resize the fleet within [fleet.min_workers, fleet.max_workers] (an external autoscaler's
        call): newcomers load the newest weights before leasing, surplus workers drain. Returns the target."""
        return self.manager.scale_to(num_workers)

    def queue_stats(self):
        """``TaskQueue.stats()``, read together with the buffer's metrics in one round trip; the pair is
        kept for ``buffer_metrics``/``fleet_values`` until the fleet next takes a batch, publishes or requeues."""
        self._snapshot = __import__("ray").get(self.buffer.snapshot.remote())
        return self._snapshot[0]

    def buffer_metrics(self):
        """``ExperienceBuffer.metrics()`` (from the ``queue_stats`` snapshot while it is current)."""
        if self._snapshot is None:
            self.queue_stats()
        return self._snapshot[1]

    def async_worker_stats(self) -> list:
        """Object refs of each worker's ``WorkerStats``."""
        return [w.stats.remote() for w in self.backend.alive_handles()]

    def worker_stats(self) -> list:
        """Each live worker's ``WorkerStats`` (one round trip per worker)."""
        return _get_alive(self.async_worker_stats())

    def state_dict(self) -> dict:
        """Queue and buffer state, taken while every worker is paused (no delivery in progress)."""
        import ray

        workers = self.backend.alive_handles()
        _get_alive([w.pause.remote() for w in workers])
        try:
            return {
                "queue": ray.get(self.queue.call.remote("state_dict")),
                "buffer": ray.get(self.buffer.state_dict.remote()),
            }
        finally:
            _get_alive([w.unpause.remote() for w in workers])

    def final_state(self):
        """Stop the workers (their unfinished leases go back to the queue) and read the accounting."""
        import ray

        from moerl.runtime.setup import FleetState

        self.manager.finish(self.backend.stop_all())
        stats = _get_alive(self.async_worker_stats())
        queue_state = ray.get(self.queue.call.remote("state_dict"))
        buffer_state = ray.get(self.buffer.state_dict.remote())
        return FleetState.from_states(
            self.queue_stats(),
            self.buffer_metrics(),
            queue_state,
            buffer_state,
            sum(s.reward_errors for s in stats),
        )

    def close(self) -> None:
        """Close the buffer (unblocks producers), stop the workers, let every actor exit, kill laggards.

        Actors first get ``__ray_terminate__`` (a clean exit after their current calls): a worker process
        killed outright sometimes aborted in Ray's C++ core and printed its stack to the driver's console.
        """
        import ray

        ray.get(self.buffer.close.remote())
        workers = self.backend.alive_handles()
        self.backend.stop_all(timeout_s=10)
        actors = [*workers, self.buffer]
        exits = [actor.__ray_terminate__.remote() for actor in actors]
        ray.wait(exits, num_returns=len(exits), timeout=5.0)
        for actor in actors:
            ray.kill(actor)  # no-op for an actor that has exited


def _get_alive(refs: list) -> list:
    """``ray.get`` each ref, skipping those of actors that died meanwhile (a lost rollout worker)."""
    import ray

    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError:
            pass
    return out
