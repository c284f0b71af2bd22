"""Async mode on Ray: the exchange actor (queue + buffer) and N rollout worker actors; the trainer in the driver.

    driver (Trainer) --get--> ExchangeActor [ExperienceBuffer --settle/requeue--> TaskQueue]
          |                         ^ put_many                              ^ lease / heartbeat
          |                         +----------- RolloutWorkerActor x N ----+
          +--publish--> WeightTransport (runtime.weight_sync) --> workers; WeightStore in the background
                        (the source of truth: workers load its newest version at start)

Resources declared per actor (a cluster maps them onto node groups):

- ``ExchangeActor`` (``exchange.py``): on the node with the ``exchange`` resource, else pinned to the
  driver's node, never on a rollout node (``moerl.cluster.placement``); losing it stops the run with
  ``ExchangeLostError`` (one line and the resume command). ``num_cpus=0`` (I/O bound); threaded (``max_concurrency``)
  because producers block in ``put_many`` on a full buffer (backpressure) while the trainer's ``get``
  must still run; both classes it holds are thread-safe. Its ``lease`` is gated
  (``rollout_allowance``): no rollout starts that would arrive too stale to train.
- ``RolloutWorkerActor`` (``worker_actor.py``): ``num_cpus=1``, ``num_gpus=1`` when ``model.device`` is
  CUDA (with ``rollout.ep_size > 1`` it is EP rank 0 and starts the other ranks, each asking for the
  same, in a placement group of its own: ``ep_group.py``), plus the custom resource ``rollout`` (0.001) when the cluster defines it (``ray start
  --resources '{"rollout": 8}'`` on rollout nodes). Workers are started, watched, replaced and drained
  by a ``FleetManager`` (``moerl.runtime.fleet``, see ``FLEET.md``) through ``RayWorkerBackend``
  (``backend.py``). ``torch.set_num_threads(1)`` unless ``MOERL_ACTOR_THREADS`` says otherwise.
- The trainer runs in the driver.

Round trips kept off the critical paths: a worker's deliveries are not waited for, its leases carry its
weights version; the trainer's version travels with its ``get`` (so ``set_version`` is not waited for),
and the per-step queue/buffer metrics are one round trip (``snapshot``).

Without ``runtime.ray_address`` a local Ray instance is started with ``num_cpus = max(cores, N)``. Ray
is imported inside functions: it is an optional dependency, needed only in async mode.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moerl.cluster.autoscale import RolloutCapacity
from moerl.cluster.placement import exchange_placement
from moerl.config import ConfigError, RunConfig
from moerl.errors import EvalVersionRefused, ExchangeLostError
from moerl.placement import Placement
from moerl.records import Group, RolloutTask
from moerl.rollout.precision_gap import LogprobGap
from moerl.rundir.storage import stage_model_folder
from moerl.runtime.accounting import FleetState
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.chaos import ChaosMonkey
from moerl.runtime.data_plane import is_dynamic_sampling
from moerl.runtime.fleet import FleetManager, WorkerRecord
from moerl.runtime.notice import notice_file_for
from moerl.runtime.queue import QueueStats
from moerl.runtime.ray.address import ray_head
from moerl.runtime.ray.backend import RayWorkerBackend
from moerl.runtime.ray.exchange import ExchangeActor
from moerl.runtime.ray.local import start_local_ray
from moerl.runtime.ray.nodes import NodeWatch
from moerl.runtime.ray.reward_pool import rollout_gpu_share
from moerl.runtime.ray.worker_actor import REFUSED_EVAL, RolloutWorkerActor, WorkerOffers
from moerl.runtime.worker import WorkerStats
from moerl.tasks.eval import EvalResult
from moerl.trainer.protocol import Trainer
from moerl.weights.buckets import bucket_bytes_of, packed_nbytes
from moerl.weights.snapshot import WeightSnapshot
from moerl.weights.store import WeightStore
from moerl.weights.transport import WeightHolder, make_transport

EVAL_ATTEMPTS = 3
"""Workers a held-out eval is tried on before the run fails (``RayRollouts.evaluate_version``)."""
EVAL_TIMEOUT_S = 600.0
"""How long one worker may take to serve an eval: its wait for the version plus the generation."""

log = logging.getLogger(__name__)


def _labels(name: str) -> dict[str, float]:
    """Custom resource ``name`` if the cluster defines it (node-group placement), else none."""
    import ray

    return {name: 0.001} if name in ray.cluster_resources() else {}


def version_lags(
    records: Iterable[WorkerRecord], ping_version: int, seen: dict[str, float]
) -> dict[str, int]:
    """worker id -> ``ping_version`` minus the engine version of the worker's liveness answer, in policy
    versions, for the workers whose answer is new since the last call (``seen``: worker id -> the
    ``last_seen`` time of the answer already counted, updated here). The fleet collects at each poll
    the answers to the pings it sent at the previous poll, so ``ping_version`` is the trainer's version
    when those were sent; a version the engine reached after the ping counts as lag 0."""
    out = {}
    for r in records:
        if r.health.policy_version >= 0 and seen.get(r.worker_id) != r.last_seen:
            seen[r.worker_id] = r.last_seen
            out[r.worker_id] = max(0, ping_version - r.health.policy_version)
    return out


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a Ray address whose head cannot be reached (``ray.init`` would retry for minutes).

    The form is checked as Ray reads it (``moerl.runtime.ray.address.ray_head``); ``host:port`` and
    ``ray://host:port`` are then probed with one TCP connection; other forms (``auto``, ``local``) are
    left to Ray.

    Raises:
        ConfigError: the address is malformed or nothing accepts a connection there within ``timeout_s``.
    """
    head = ray_head(address)
    if head is None:
        return
    host, port = head
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"runtime.ray_address={address!r}: cannot reach {host}:{port} ({e})") from e


def init_ray(cfg: RunConfig) -> None:
    """Connect to ``runtime.ray_address`` or start a local Ray instance, keeping this process's SIGTERM
    handler: ``ray.init`` installs its own (``sys.exit``), which would bypass the run's (a SIGTERM
    stops a run like Ctrl-C). A Ctrl-C (SIGINT) during ``ray.init`` is held until Ray is up, then Ray is
    shut down and ``KeyboardInterrupt`` raised: no Ray process outlives the run. A local start that misses
    Ray's raylet wait on a loaded host is tried again (``start_local_ray``), but not after a Ctrl-C.
    Nothing to do when this process is connected already (a trainer group's rank actors started it, or
    the caller did).

    Raises:
        KeyboardInterrupt: SIGINT arrived while Ray started (main thread only), or SIGTERM did (``ray.init``
            installs a SIGTERM handler that exits; its exit is turned into the run's Ctrl-C).
        RayStartError: a local start timed out in every attempt (``start_local_ray``).
    """
    import ray

    if ray.is_initialized():
        return
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if is_main else None
    # Ctrl-C while Ray starts its processes would leave some running after the run: held until it is up
    interrupted: list[int] = []
    previous_int = signal.signal(signal.SIGINT, lambda n, _: interrupted.append(n)) if is_main else None
    failed = None
    try:
        _ray_init(cfg, ray, should_stop=lambda: bool(interrupted))
    except SystemExit as e:  # ray.init's own SIGTERM handler exits: the run stops as on SIGTERM (Ctrl-C)
        if e.code != signal.SIGTERM:
            raise
        interrupted.append(signal.SIGTERM)
        failed = e
    except Exception as e:
        if not interrupted:
            raise
        failed = e  # Ray did not start and a Ctrl-C came meanwhile: the run stops as on Ctrl-C
    finally:
        if is_main:
            signal.signal(signal.SIGINT, previous_int)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    if interrupted:  # then stop what started, and the run
        ray.shutdown()
        raise KeyboardInterrupt from failed


def plain_worker_prefixes(stream) -> None:
    """Where ``stream`` (the driver's stderr) is no terminal, the ``(RolloutWorkerActor pid=...)`` prefixes
    Ray puts on the workers' lines it prints here come without ANSI colour codes (``RAY_COLOR_PREFIX=0``,
    read by Ray's driver-side log printer), so a run's log file reads as text; a value the user set stays."""
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _ray_init(cfg: RunConfig, ray, should_stop: Callable[[], bool]) -> None:
    """``ray.init``: the cluster at ``runtime.ray_address``, or a new local instance sized for the run
    (``start_local_ray``: started again when Ray's fixed wait for its raylet runs out on a loaded host,
    unless ``should_stop()``: a Ctrl-C arrived meanwhile)."""
    plain_worker_prefixes(sys.stderr)
    if cfg.runtime.ray_address:
        ray.init(address=cfg.runtime.ray_address, log_to_driver=True)
    else:
        ranks = cfg.rollout.num_workers * cfg.rollout.ep_size  # rollout processes, one CPU each
        # a trainer group's rank actors need a (fractional) CPU beside them (moerl.trainer.distributed.ray_ranks)
        trainer_cpus = int(Placement.from_config(cfg).trainer.needs_ray_first)
        rw = cfg.reward  # reward workers (moerl.runtime.ray.reward_pool)
        reward_cpus = math.ceil(rw.num_workers * rw.cpus_per_worker) if rw.is_enabled else 0
        start_local_ray(  # a new instance, as documented: never another process's running cluster
            should_stop=should_stop,
            num_cpus=max(os.cpu_count() or 1, ranks + trainer_cpus + reward_cpus),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        # the trainer (this process) gets the cores the local workers do not use
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - ranks))


class RayRollouts:
    """The async-mode rollout side (module docstring); implements ``moerl.runtime.rollouts.Rollouts``.

    Args:
        cfg: the run config (``rollout.num_workers`` workers; ``runtime.ray_address``).
        init_path: HF folder the workers build their model from (weights then come from the store).
        store_url: the weight store; version ``version`` must already be published.
        version: the trainer's current policy version.
        parts: checkpoint parts with ``queue`` and ``buffer`` state to restore, or None.
        notice_dir: the folder of the workers' notice files (``<worker_id>.json``) when
            ``fleet.notice_file`` is unset; None: notices by actor call only.
        store: the run's weight store, written by the weight transport (``runtime.weight_sync``,
            ``moerl.weights.transport``) every ``runtime.durable_every`` versions (None: never written
            from here).
    """

    def __init__(
        self,
        cfg: RunConfig,
        init_path: str | None,
        store_url: str,
        *,
        version: int,
        parts: dict | None,
        notice_dir: str | Path | None = None,
        store: WeightStore | None = None,
    ):
        import ray

        init_ray(cfg)
        self._milestones = {"ray_started": time.perf_counter()}
        # a remote store: the model folder goes there too, so actors on other machines share no folder
        init_path = stage_model_folder(init_path, store_url, cfg.storage.options)
        # the run's state: on the `exchange` node or the driver's own, never a rollout node
        placement = exchange_placement(ray.cluster_resources(), ray.get_runtime_context().get_node_id())
        exchange_cls = ray.remote(num_cpus=0, max_concurrency=cfg.rollout.num_workers * 2 + 16)(ExchangeActor)
        self.exchange = exchange_cls.options(**placement.ray_options()).remote(
            cfg, init_path, version, dynamic_sampling=is_dynamic_sampling(cfg)
        )
        node = self.exchange.node.remote()  # asked once the workers are spawned: they start meanwhile
        if parts is not None:
            ray.get(
                self.exchange.load_state_dict.remote({"queue": parts["queue"], "buffer": parts["buffer"]})
            )
        gpus = 1 if cfg.model.device.startswith("cuda") else 0
        rw = cfg.reward
        if gpus and rw.is_enabled and cfg.rollout.ep_size == 1 and "reward" not in ray.cluster_resources():
            # reward workers beside the rollout workers on this machine's GPUs (no reward node group)
            try:
                gpus = rollout_gpu_share(
                    ray.cluster_resources().get("GPU", 0.0),
                    cfg.rollout.num_workers,
                    rw.num_workers * rw.gpus_per_worker,
                )
            except ValueError as e:
                raise ConfigError(f"reward.gpus_per_worker={rw.gpus_per_worker}: {e}") from None
        worker_cls = ray.remote(num_cpus=1, num_gpus=gpus, max_concurrency=4, resources=_labels("rollout"))(
            RolloutWorkerActor
        )
        notices = None if notice_dir is None else str(notice_dir)
        self.cfg = cfg
        # runtime.weight_sync: trainer -> transport -> workers (moerl.weights.transport)
        self.transport = make_transport(cfg.runtime, store)
        weights = self.transport.receiver_spec()

        def spawn(wid: str):
            handle = worker_cls.remote(  # the run's version 0 is init_path's weights: not loaded twice
                cfg, wid, init_path, store_url, self.exchange, notices, weights=weights, init_version=0
            )
            self.transport.offer_newest(WorkerOffers(handle))  # after its store load: a newer version
            return handle

        self.backend = RayWorkerBackend(
            spawn,
            notice_path=lambda wid: notice_file_for(cfg.fleet, wid, notices),
        )
        self.manager = FleetManager.from_config(cfg.fleet, cfg.rollout.num_workers, self.backend)
        # on a cluster with a rollout node group: the scaling hint asks the Ray autoscaler for nodes
        self.capacity = RolloutCapacity.for_ray(
            gpus_per_worker=gpus * cfg.rollout.ep_size,
            min_workers=self.manager.min_workers,
            max_workers=self.manager.max_workers,
        )
        self.chaos = ChaosMonkey(cfg.chaos)
        self.manager.start()
        self._milestones["workers_spawned"] = time.perf_counter()
        self._exchange_node = self._ask(node)
        self._milestones["exchange_ready"] = time.perf_counter()
        self._last_batch = time.perf_counter()
        self._next_check = 0.0
        self._version = version  # the trainer's policy version, sent with each batch request
        self._snapshot: tuple[QueueStats, BufferMetrics] | None = None  # this step's, from ``snapshot``
        self._sync_values: dict[str, float] = {}  # the last push's trainer-side figures
        self._lags: dict[str, int] = {}  # worker id -> version lag of its latest liveness answer
        self._seen: dict[str, float] = {}  # worker id -> time of the answer its lag comes from
        self._ping_version = version  # the trainer's version when the fleet's pings went out
        # runtime.overlap_publish: one version at a time sent from a device copy on a thread
        self._overlap = (  # the transport says whether it can send from a device copy
            cfg.runtime.overlap_publish
            and self.transport.sends_from_snapshot
            and not Placement.from_config(cfg).trainer.is_group
        )
        self._sending: threading.Thread | None = None
        self._send_error: BaseException | None = None
        self._spare: dict | None = None  # the last sent snapshot's device copies, reused by the next one
        self._store = store
        self.nodes = NodeWatch()  # Ray nodes lost during the run: an event in the log and the metrics

    def _ask(self, ref):
        """``ray.get`` of an exchange call; the exchange's death (its node lost, killed) becomes an
        ``ExchangeLostError``, one line, instead of Ray's traceback.

        Raises:
            ExchangeLostError: the exchange actor died.
        """
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            # the first line says how it died; the last, for an error in its creation, which error
            first = (
                " ... ".join(dict.fromkeys([lines[0][:200], lines[-1][:300]])) if lines else type(e).__name__
            )
            raise ExchangeLostError(
                f"the exchange actor (task queue, experience buffer) was lost, its node gone or unreachable "
                f"({type(e).__name__}: {first}); the run stopped after its last whole step"
            ) from None

    def check_fleet(self, *, force: bool = False) -> None:
        """Every ``fleet.check_every_s``: liveness and replacements (``FleetManager.check``), chaos faults.

        Raises:
            RuntimeError: a worker's loop raised (its error), or no rollout worker is left.
            ExchangeLostError: the exchange actor died (a worker's loop failing on it is reported as this).
        """
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + self.cfg.fleet.check_every_s
        try:
            exits = self.manager.check()
        except Exception:  # a worker loop that failed on a lost exchange: that loss is the error to report
            self._ask(self.exchange.snapshot.remote())
            raise
        # the version lag of each new liveness answer against the trainer's version when its ping went
        # out (the previous poll): taken against the version of a later step, it would grow by one per
        # step while the answer ages
        self._lags.update(version_lags(self.manager.records.values(), self._ping_version, self._seen))
        self._ping_version = self._version
        for line in self.nodes.poll():
            log.warning(line)
        for e in exits:
            if e.reason == "crashed":  # expire its leases now (with their newest progress snapshots)
                restored = self._ask(self.exchange.expire_worker.remote(e.worker_id))
                self.manager.credit_restored(e.worker_id, restored)
        if self.chaos.is_enabled:
            self.chaos.apply(self.chaos.due(self.manager.busy_ids()), self.backend)
        if not self.manager.active_ids():
            raise RuntimeError("no rollout worker is left (fleet.min_workers=0 and every worker is gone)")

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Take ``n`` groups from the buffer, waiting while the fleet fills it.

        Returns:
            ``(groups, seconds since the previous batch, seconds waited)``.
        """
        start = time.perf_counter()
        while True:
            self.check_fleet()
            try:
                groups = self._ask(
                    self.exchange.get.remote(n, timeout=self.cfg.fleet.check_every_s, version=self._version)
                )
                break
            except TimeoutError:  # Ray re-raises the actor's TimeoutError as a subclass of it
                pass
        now = time.perf_counter()
        gen_s, self._last_batch = now - self._last_batch, now
        self._snapshot = None
        return groups, gen_s, now - start

    def publish(
        self,
        trainer: WeightHolder,
        *,
        is_stored: bool = False,
        is_final: bool = False,
        is_durable: bool = False,
    ) -> None:
        """Send the trainer's current version through the run's weight transport and advance the
        staleness clock to it.

        The transport asks the trainer for its buckets (a trainer group's rank 0 sends them itself) and
        moves them to the workers; nothing passes through here. The version goes to the exchange without
        waiting (workers' admissions see it a round trip later); the next ``next_groups`` carries it
        too, so the trainer's batch is always taken at it. ``is_stored``: the caller already wrote the
        version to the store; ``is_final``: the run's last version, made durable before returning;
        ``is_durable``: a version that must reach the store (a checkpoint's), written in the background
        like every ``durable_every``-th. With ``runtime.overlap_publish`` the send runs on a thread from a
        device copy (``WeightSnapshot``) while the trainer trains on.

        Raises:
            WeightWriteError: an earlier background write to the store failed (one line).
        """
        version = trainer.version
        self._version, self._snapshot = version, None
        self.exchange.set_version.remote(version)
        self.wait_sent()  # the previous version's background send (runtime.overlap_publish)
        if self._store is not None:
            self._store.check_writes()  # a failed background write stops the run here
        workers = [WorkerOffers(h) for h in self.backend.alive_handles()]  # each worker's OfferSink
        durable = False if is_stored else (True if is_durable else None)
        t0 = time.perf_counter()
        if self._overlap and not (is_stored or is_final):
            spare, self._spare = self._spare, None
            named = dict(trainer.named_weights())
            fence = self._store.writer.copies if self._store is not None else None
            if fence is None:  # nobody would wait for a copy taken later: take it now
                taken = WeightSnapshot(version, named, reuse=spare)
                take = lambda: taken  # noqa: E731
            else:
                fence.begin()  # the trainer's next optimizer step waits for the copy (moerl.train)
                take = lambda: WeightSnapshot(version, named, reuse=spare)  # noqa: E731
            self._sending = threading.Thread(
                target=self._send, args=(take, fence, workers, durable), name="moerl-publish", daemon=True
            )
            self._sending.start()
            bucket_bytes = bucket_bytes_of(self.cfg.runtime.publish_bucket_mb)
            self._sync_values = {  # the bytes this version moves (the send itself is under way)
                "timing/weight_sync_s": time.perf_counter() - t0,
                "weights/sync_bytes": packed_nbytes(named, bucket_bytes) * len(workers),
            }
            return
        report = self.transport.publish(trainer, workers, durable=durable)
        self._sync_values = {
            "timing/weight_sync_s": time.perf_counter() - t0,
            "weights/sync_bytes": report.bytes_moved,
        }
        if is_final:
            self.transport.finish(trainer)

    def start_milestones(self) -> dict[str, float]:
        """``Rollouts.start_milestones``: ``ray_started``, ``workers_spawned``, ``exchange_ready``."""
        return dict(self._milestones)

    def make_durable(self, trainer: WeightHolder) -> None:
        """``Rollouts.make_durable``: the background send of the version landed (``wait_sent``; a due
        durable write of that send is queued before this writes), then the transport's ``finish``."""
        self.wait_sent()
        self.transport.finish(trainer)

    def _send(self, take, fence, workers: list, durable: bool | None) -> None:
        """The background send of ``runtime.overlap_publish``: ``take()`` makes the device copy
        (``WeightSnapshot``, into the previous send's buffers), then ``fence`` (the store writer's
        ``PendingCopies``, begun by ``publish``) is released and the version sent from the copy (on a side
        CUDA stream after it); the copy's buffers are kept for the next send."""
        try:
            try:
                snapshot = take()
            finally:
                if fence is not None:
                    fence.end()
            with snapshot.stream_context():
                self.transport.publish(snapshot, workers, durable=durable)
            self._spare = snapshot.tensors  # read by nobody now: the transport copied what it sends
        except BaseException as e:  # raised in the driver by the next publish (wait_sent)
            self._send_error = e

    def wait_sent(self) -> None:
        """Block until the background send of the last version (if any) is done; raise its error."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            raise error

    def published_version(self) -> int:
        """``Rollouts.published_version``: the trainer's version last published (or started at)."""
        return self._version

    def evaluate(self, trainer: Trainer, prompts: list | None) -> EvalResult:
        """``Rollouts.evaluate`` on a rollout worker: ``trainer``'s current version, published first when
        this step did not (``publish``), evaluated by one worker (``evaluate_version``).

        Raises:
            EvalVersionRefused, RuntimeError: as ``evaluate_version``.
        """
        if self._version != trainer.version:  # not a publish step: the workers need it
            self.publish(trainer)
        return self.evaluate_version(prompts, trainer.version)

    def precision_gap(self, trainer: Trainer, groups: list[Group]) -> LogprobGap | None:
        """``Rollouts.precision_gap``: None (the engines are in the worker processes)."""
        return None

    def engine_model(self) -> torch.nn.Module | None:
        """``Rollouts.engine_model``: None (each worker's engine holds its own model)."""
        return None

    def evaluate_version(
        self, prompts: list | None, version: int, *, timeout_s: float = EVAL_TIMEOUT_S
    ) -> EvalResult:
        """Held-out greedy accuracy of policy ``version`` (published already) on ``prompts``, evaluated by
        one rollout worker (``RolloutWorkerActor.evaluate``; an EP group's leader evaluates with all its
        ranks): the driver needs no copy of the policy. A worker lost or failing during the eval: the
        eval goes to the next live worker (replacements included), ``EVAL_ATTEMPTS`` tries in all.

        Raises:
            EvalVersionRefused: every worker tried had refused ``version``.
            RuntimeError: every try failed (the last worker's error), or no rollout worker is left.
        """
        import ray

        errors: list[str] = []
        tried: set[str] = set()
        while len(errors) < EVAL_ATTEMPTS:
            self.check_fleet(force=True)  # a lost worker is noticed (and replaced) before the next try
            handles = self.backend.handles
            candidates = [w for w in self.manager.active_ids() if w in handles]
            if not candidates:
                raise RuntimeError(f"held-out eval of v{version}: no rollout worker is left")
            worker_id = next((w for w in candidates if w not in tried), candidates[0])
            tried.add(worker_id)
            try:
                return ray.get(handles[worker_id].evaluate.remote(prompts, version, timeout_s))
            except ray.exceptions.RayError as e:  # died (RayActorError) or failed (the actor's error)
                errors.append(f"{worker_id}: {str(e).strip().splitlines()[-1][:300]}")
        if all(REFUSED_EVAL in e for e in errors):  # a damaged version: no worker will ever hold it
            raise EvalVersionRefused(f"held-out eval of v{version} skipped: {errors[-1]}")
        raise RuntimeError(
            f"held-out eval of v{version} failed on {EVAL_ATTEMPTS} tries: {'; '.join(errors)}"
        )

    def sync_values(self) -> dict[str, float]:
        """The step's weight-sync metrics: trainer side of the last push (``timing/weight_sync_s``,
        ``weights/sync_bytes``), and from the workers' last liveness answers the slowest worker-side
        sync (``timing/weight_sync_worker_s``) and the version lag (trainer version minus the worker's
        engine version, ``version_lags``, refreshed at each fleet poll, every ``fleet.check_every_s``;
        ``weights/version_lag_max``, ``weights/version_lag_mean``), and the weight versions the workers
        refused so far, every worker seen counted, gone ones with their last answer
        (``weights/refused_total``)."""
        alive = set(self.manager.active_ids())
        healths = [
            r.health
            for r in self.manager.records.values()
            if r.worker_id in alive and r.health.policy_version >= 0
        ]
        lags = [lag for worker_id, lag in self._lags.items() if worker_id in alive]
        syncs = [h.weight_sync_s for h in healths if h.weight_sync_s is not None]
        return {
            **self._sync_values,
            "timing/weight_sync_worker_s": max(syncs) if syncs else None,
            "weights/version_lag_max": max(lags) if lags else None,
            "weights/version_lag_mean": sum(lags) / len(lags) if lags else None,
            "weights/refused_total": sum(r.health.weights_refused for r in self.manager.records.values()),
        }

    def requeue(self, task: RolloutTask) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        self._snapshot = None
        self._ask(self.exchange.requeue.remote(task))

    def fleet_values(self, batch_groups: int) -> dict[str, float]:
        """The step's ``fleet/*`` metrics, with the scaling hint from queue and buffer depth; on a cluster
        with a ``rollout`` resource the hint also requests rollout nodes from the Ray autoscaler and
        resizes the fleet to it (``moerl.cluster.autoscale``); and the weight-sync metrics (``sync_values``)."""
        queue, buffer = self._current_snapshot()
        pending, depth = queue.pending, buffer.depth
        hint = self.manager.scaling_hint(queue_pending=pending, buffer_depth=depth, batch_groups=batch_groups)
        if self.capacity is not None and self.capacity.update(hint.desired_workers) is not None:
            self.manager.scale_to(self.capacity.requested)  # newcomers wait for the new nodes
        values = {
            **self.manager.metrics().as_metrics(),
            **self.sync_values(),
            "fleet/nodes_lost": len(self.nodes.lost),
        }
        if self.cfg.reward.is_enabled:  # the reward workers' figures, kept by the exchange
            import ray

            values.update(ray.get(self.exchange.reward_values.remote()))
        return values

    def worker_records(self) -> list[WorkerRecord]:
        """The fleet manager's record of every worker seen (state and last heartbeat); only reads."""
        return list(self.manager.records.values())

    def policy_lags(self) -> dict[str, int]:
        """``version_lags`` of each worker's latest liveness answer, refreshed at each fleet poll; only
        reads (a copy, safe from the scrape thread)."""
        return dict(self._lags)

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
            "tokens_in_flight_at_losses": self.manager.tokens_in_flight_at_losses,
            "rollout/tokens_resumed": m.rollout_tokens_resumed,
            "rollout/tokens_discarded": m.rollout_tokens_discarded,
            "tokens_restored_from_snapshots": q.tokens_restored,
            "snapshots_saved": q.snapshots_saved,
            "snapshots_refused": q.snapshots_refused,
            "worker_tokens": {
                r.worker_id: {
                    "tokens_resumed": r.health.tokens_resumed,
                    "tokens_discarded": r.tokens_discarded,
                }
                for r in self.manager.records.values()
            },
            "tasks_released": q.released,
            "tasks_expired": q.expired,
            "tasks_requeued_stale": q.requeued_stale,
            "chaos": self.chaos.counts(),
            "ep_size": self.cfg.rollout.ep_size,
            "exchange_node": self._exchange_node,  # where the queue and buffer lived (moerl.cluster.placement)
            # EP rollout groups: each worker's rank process ids as its last liveness answer gave them
            "worker_rank_pids": {
                r.worker_id: list(r.health.rank_pids)
                for r in self.manager.records.values()
                if r.health.rank_pids
            },
        }

    def scale_to(self, num_workers: int) -> int:
        """Resize the fleet within [fleet.min_workers, fleet.max_workers] (an external autoscaler's
        call): newcomers load the newest weights before leasing, surplus workers drain. Returns the target."""
        return self.manager.scale_to(num_workers)

    def _current_snapshot(self) -> tuple[QueueStats, BufferMetrics]:
        if self._snapshot is None:
            self.queue_stats()
        assert self._snapshot is not None
        return self._snapshot

    def queue_stats(self) -> QueueStats:
        """``TaskQueue.stats()``, read together with the buffer's metrics in one round trip; the pair is
        kept for ``buffer_metrics``/``fleet_values`` until the fleet next takes a batch, publishes or requeues."""
        self._snapshot = self._ask(self.exchange.snapshot.remote())
        return self._snapshot[0]

    def buffer_metrics(self) -> BufferMetrics:
        """``ExperienceBuffer.metrics()`` (from the ``queue_stats`` snapshot while it is current)."""
        return self._current_snapshot()[1]

    def worker_stats(self) -> list[WorkerStats]:
        """``WorkerStats`` of every live worker that answers within ``fleet.heartbeat_timeout_s`` (one
        deadline for all). Those that died meanwhile, and those that did not answer in time (a worker on a
        lost or partitioned node, which Ray declares dead only after its own health checks, 30-60 s), are
        left out: the step's metrics go without them rather than the step waiting on them."""
        refs = [w.worker_stats.remote() for w in self.backend.alive_handles()]
        return _get_alive(refs, timeout_s=self.cfg.fleet.heartbeat_timeout_s)

    def state_dict(self) -> dict:
        """Queue and buffer state, taken while every worker is paused (no delivery in progress)."""
        workers = self.backend.alive_handles()
        _get_alive([w.pause.remote() for w in workers])
        try:
            return self._ask(self.exchange.state_dict.remote())
        finally:
            _get_alive([w.unpause.remote() for w in workers])

    def final_state(self) -> FleetState:
        """Stop the workers (their unfinished leases go back to the queue) and read the accounting."""
        self.manager.finish(self.backend.stop_all())
        stats = self.worker_stats()
        state = self._ask(self.exchange.state_dict.remote())
        return FleetState.from_states(
            self.queue_stats(),
            self.buffer_metrics(),
            state["queue"],
            state["buffer"],
            sum(s.reward_errors for s in stats),
        )

    def close(self) -> None:
        """Close the buffer (unblocks producers), stop the workers, let every actor exit, kill laggards.

        Actors first get ``__ray_terminate__`` (a clean exit after their current calls): a worker process
        killed outright sometimes aborted in Ray's C++ core and printed its stack to the driver's console.
        """
        import ray

        if self._sending is not None:  # a version still on its way: let it land (its error is moot now)
            self._sending.join()
            self._sending = None
        try:
            ray.get(self.exchange.close.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # lost with its node (ExchangeLostError): the workers are stopped all the same
        workers = self.backend.alive_handles()
        self.backend.stop_all(timeout_s=10)
        actors = [*workers, self.exchange]
        exits = [actor.__ray_terminate__.remote() for actor in actors]
        ray.wait(exits, num_returns=len(exits), timeout=5.0)
        for actor in actors:
            ray.kill(actor)  # no-op for an actor that has exited
        self.transport.close()


def _get_alive(refs: list, timeout_s: float | None = None) -> list:
    """``ray.get`` each ref, in order, skipping those of actors that died meanwhile (a lost rollout worker)
    and, with ``timeout_s`` (seconds, one deadline for all refs), those not ready by then."""
    import ray

    if timeout_s is not None and refs:
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
        refs = [ref for ref in refs if ref in ready]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError:
            pass
    return out
