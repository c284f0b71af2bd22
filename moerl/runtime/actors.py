"""Async mode on Ray: the queue, the buffer and N rollout workers as actors; the trainer in the driver.

    driver (Trainer) --get--> ExchangeActor [ExperienceBuffer --settle/requeue--> TaskQueue]
          |                         ^ put                                   ^ lease / heartbeat
          |                         +----------- RolloutWorkerActor x N ----+
          +--publish--> WeightStore (source of truth) <--poll-- workers
          +--ray.put(weights)--> object store --offer--> workers (faster path, same versions)

Resources declared per actor (a cluster maps them onto node groups):

- ``ExchangeActor``: the ``TaskQueue`` and the ``ExperienceBuffer`` in one lightweight actor
  (``num_cpus=0``, I/O bound), so that settling a delivered group in the queue is a local call.
  Threaded (``max_concurrency``) because producers block in ``put`` on a full buffer (backpressure)
  while the trainer's ``get`` must still run; both classes are thread-safe.
- ``RolloutWorkerActor``: ``num_cpus=1``, ``num_gpus=1`` when ``model.device`` is CUDA, plus the
  custom resource ``rollout`` (0.001) when the cluster defines it (``ray start --resources
  '{"rollout": 8}'`` on rollout nodes). Two threads: the generation loop and control calls
  (``pause``/``stop``/``offer_weights``). ``torch.set_num_threads(1)`` unless ``MOERL_ACTOR_THREADS``
  says otherwise, so N workers and the trainer share a small machine without oversubscription.
- The trainer runs in the driver (custom resource ``train`` is not needed).

Without ``--ray-address`` a local Ray instance is started with ``num_cpus = max(cores, N)``.
Methods that return object refs are prefixed ``async_``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping

import torch

from moerl.config import RunConfig
from moerl.runtime.buffer import BufferClosed
from moerl.runtime.types import Group


def _remote_call(handle, method: str, *args, **kwargs):
    return __import__("ray").get(getattr(handle, method).remote(*args, **kwargs))


class ActorProxy:
    """Calls a Ray actor's methods synchronously (``proxy.lease(...)`` = ``ray.get(h.lease.remote(...))``),
    so that ``RolloutWorker`` and ``ExperienceBuffer`` use an actor as they use a local object."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: _remote_call(self._handle, name, *args, **kwargs)


def _set_threads() -> None:
    torch.set_num_threads(int(os.environ.get("MOERL_ACTOR_THREADS", "1")))


class ExchangeActorImpl:
    """The ``TaskQueue`` and the ``ExperienceBuffer`` in one actor process.

    Co-located so that the buffer's ``settle``/``requeue`` (one per delivered group) are local calls
    instead of a second actor round trip; workers reach the queue through ``call`` and the buffer
    through ``put``; the trainer through ``get``/``set_version``.
    """

    def __init__(self, cfg: RunConfig, tokenizer_path: str | None, version: int):
        from moerl.runtime.setup import make_buffer, make_queue
        from moerl.tasks import load_tokenizer, make_task

        self.queue = make_queue(cfg, make_task(cfg.task), load_tokenizer(tokenizer_path))
        self.buffer = make_buffer(cfg, self.queue, version=version)

    def call(self, method: str, *args, **kwargs):
        """Run ``TaskQueue.<method>``."""
        return getattr(self.queue, method)(*args, **kwargs)

    def put(self, group: Group, trainer_version=None, timeout=None):
        return self.buffer.put(group, trainer_version=trainer_version, timeout=timeout)

    def put_many(self, groups: list[Group], timeout=None) -> list:
        """``put`` each group in order; ``None`` from the first that timed out on a full buffer on."""
        results = []
        for group in groups:
            try:
                results.append(self.buffer.put(group, timeout=timeout))
            except TimeoutError:
                return results + [None] * (len(groups) - len(results))
        return results

    def get(self, batch_size: int, timeout=None):
        return self.buffer.get(batch_size, timeout=timeout)

    def set_version(self, version: int) -> None:
        self.buffer.set_version(version)

    def metrics(self):
        return self.buffer.metrics()

    def state_dict(self):
        return self.buffer.state_dict()

    def load_state_dict(self, state) -> None:
        self.buffer.load_state_dict(state)

    def close(self) -> None:
        self.buffer.close()


class _QueueProxy:
    """The queue methods a worker needs, as blocking calls to the queue actor."""

    def __init__(self, handle):
        self.handle = handle

    def lease(self, worker_id, ttl_s, max_tasks=1):
        return _remote_call(self.handle, "call", "lease", worker_id, ttl_s, max_tasks)

    def heartbeat(self, target, ttl_s=None):
        return _remote_call(self.handle, "call", "heartbeat", target, ttl_s)

    def release(self, lease):
        return _remote_call(self.handle, "call", "release", lease)

    def settle(self, task_id, token, outcome):
        return _remote_call(self.handle, "call", "settle", task_id, token, outcome)


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
            return offer[0], __import__("ray").get(offer[1])
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
        from moerl.runtime.worker import StoreWeights
        from moerl.tasks import load_tokenizer, make_task
        from moerl.tasks.tokenizer import tokenizer_path_for

        torch.manual_seed(cfg.seed)
        tokenizer = load_tokenizer(tokenizer_path_for(cfg.task.tokenizer, init_path or cfg.model.path))
        model = load_policy(cfg, init_path, tokenizer.vocab_size)
        self.weights = _OfferedWeights(StoreWeights(WeightStore(store_url, keep=cfg.runtime.keep_versions)))
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._stop = threading.Event()
        self.worker = make_worker(
            cfg,
            worker_id,
            model,
            make_task(cfg.task),
            tokenizer,
            _QueueProxy(queue_handle),
            ActorProxy(buffer_handle),
            self.weights,
            version=-1,
        )
        self.worker.pause_point = self._pause_point
        self.worker.sync_weights()  # the newest published version before the first lease

    def _pause_point(self) -> None:
        while self._pause.is_set() and not self._stop.is_set():
            self._paused.set()
            time.sleep(0.01)
        self._paused.clear()

    def run(self) -> int:
        """Generate until ``stop``; returns groups delivered. Unfinished leases go back to the queue."""
        delivered = 0
        try:
            while not self._stop.is_set():
                delivered += len(self.worker.step())
                if not self.worker.num_in_flight:
                    time.sleep(0.01)
        except BufferClosed:
            pass
        finally:
            self._paused.set()
            self.worker.release_all()
        return delivered

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

    def stats(self):
        return self.worker.stats


def _labels(name: str) -> dict[str, float]:
    """Custom resource ``name`` if the cluster defines it (node-group placement), else none."""
    import ray

    return {name: 0.001} if name in ray.cluster_resources() else {}


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
        self.workers = [
            worker_cls.remote(cfg, f"rollout-{i}", init_path, store_url, self.queue, self.buffer)
            for i in range(cfg.rollout.num_workers)
        ]
        self.runs = [w.run.remote() for w in self.workers]
        self._last_batch = time.perf_counter()

    def _check_workers(self) -> None:
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            ray.get(ref)  # re-raises the worker's error
        if done:
            raise RuntimeError(f"{len(done)} rollout worker(s) exited early")

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Take ``n`` groups from the buffer, waiting while the fleet fills it.

        Returns:
            ``(groups, seconds since the previous batch, seconds waited)``.
        """
        import ray

        start = time.perf_counter()
        while True:
            try:
                groups = ray.get(self.buffer.get.remote(n, timeout=1.0))
                break
            except TimeoutError:  # Ray re-raises the actor's TimeoutError as a subclass of it
                self._check_workers()
        now = time.perf_counter()
        gen_s, self._last_batch = now - self._last_batch, now
        return groups, gen_s, now - start

    def push_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Advance the staleness clock and offer the new weights via the object store."""
        import ray

        ray.get(self.buffer.set_version.remote(version))
        ref = ray.put({k: v.detach().cpu().clone() for k, v in tensors.items()})
        for w in self.workers:
            w.offer_weights.remote(version, [ref])

    def queue_stats(self):
        return __import__("ray").get(self.queue.call.remote("stats"))

    def buffer_metrics(self):
        return __import__("ray").get(self.buffer.metrics.remote())

    def async_worker_stats(self) -> list:
        """Object refs of each worker's ``WorkerStats``."""
        return [w.stats.remote() for w in self.workers]

    def state_dict(self) -> dict:
        """Queue and buffer state, taken while every worker is paused (no delivery in progress)."""
        import ray

        ray.get([w.pause.remote() for w in self.workers])
        try:
            return {
                "queue": ray.get(self.queue.call.remote("state_dict")),
                "buffer": ray.get(self.buffer.state_dict.remote()),
            }
        finally:
            ray.get([w.unpause.remote() for w in self.workers])

    def final_state(self):
        """Stop the workers (their unfinished leases go back to the queue) and read the accounting."""
        import ray

        from moerl.runtime.setup import FleetState

        for w in self.workers:
            w.stop.remote()
        ray.get(self.runs)
        stats = ray.get(self.async_worker_stats())
        queue_state = ray.get(self.queue.call.remote("state_dict"))
        buffer_state = ray.get(self.buffer.state_dict.remote())
        return FleetState(
            queue=self.queue_stats(),
            buffer=self.buffer_metrics(),
            queued_task_ids=tuple(t["task_id"] for t in queue_state["tasks"]),
            buffered_task_ids=tuple(g["task"]["task_id"] for g in buffer_state["groups"]),
            reward_errors=sum(s.reward_errors for s in stats),
        )

    def close(self) -> None:
        """Close the buffer (unblocks producers), stop and kill the actors."""
        import ray

        ray.get(self.buffer.close.remote())
        for w in self.workers:
            w.stop.remote()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in [*self.workers, self.buffer]:
            ray.kill(actor)
