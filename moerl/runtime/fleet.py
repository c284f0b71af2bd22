"""The elastic rollout fleet: keep N workers alive, notice losses, replace them, admit newcomers, hint a size.

Rollout workers hold no state that training depends on, so they may run on interruptible machines.
``FleetManager`` is the driver's view of them; it never talks to Ray itself but to a
``WorkerBackend`` (``moerl.runtime.ray.backend.RayWorkerBackend`` in async mode, a scripted fake in tests):

    start():  spawn ``num_workers`` workers
    check():  (every ``check_every_s``, called by the driver between steps and while it waits)
              poll the backend: liveness answers (with each worker's health), and exits
              an exit after a drain            -> drained  (an interruption)
              an exit with an error (SIGKILL)  -> killed   (an interruption); its in-flight tokens are lost
              no answer for heartbeat_timeout_s -> lost    (killed, counted as killed); backend.kill()
              spawn replacements up to the target (never fewer than min_workers)

A replacement (or a newcomer from ``admit``/``scale_to``) loads the newest published weight version
before it leases its first task (the backend's worker does that in its constructor); it counts as
alive from its first liveness answer. ``time_to_replace_s`` runs from the moment a loss is detected to
that first answer.

Leases of a lost worker are not the fleet's business: they expire in the ``TaskQueue`` and the tasks
are leased again; a late delivery from a worker presumed dead is refused by its fencing token.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from moerl.runtime.drain import DrainReport


class WorkerState(enum.StrEnum):
    """Life of one rollout worker as the driver sees it."""

    STARTING = "starting"
    """Spawned, not yet answered a liveness ping (building its engine, loading weights)."""
    ALIVE = "alive"
    """Answering pings."""
    DRAINED = "drained"
    """Exited cleanly after a termination notice."""
    KILLED = "killed"
    """Died (process killed, node lost, crashed) or stopped answering pings."""
    STOPPED = "stopped"
    """Exited cleanly on request (end of run, scale-down)."""


_GONE = (WorkerState.DRAINED, WorkerState.KILLED, WorkerState.STOPPED)

EXPIRE_NOW_TTL_S = 1e-9
"""Lease ttl that expires a lost worker's leases at the queue's next call: ``queue.heartbeat(worker_id,
EXPIRE_NOW_TTL_S)`` renews them to end now, so their tasks go back to the queue without waiting for
``lease_ttl_s``. Safe when the worker is in fact alive: its late deliveries are refused by fencing."""


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """A worker's answer to a liveness ping."""

    tokens_delivered: int = 0
    """Response tokens of the groups it delivered so far (cumulative)."""
    tokens_in_flight: int = 0
    """Response tokens generated for groups not yet delivered (lost if it dies now)."""
    groups_in_flight: int = 0
    """Groups being generated."""
    policy_version: int = -1
    """Version of the weights in its engine."""
    is_draining: bool = False
    """It received a termination notice and is draining."""
    pid: int = 0
    """Its process id (0: unknown); chaos SIGKILLs it by this on the same host."""
    hostname: str = ""
    """Host it runs on (``socket.gethostname()``)."""
    node: str = ""
    """The Ray node it runs on, as its IP address (``ray.util.get_node_ip_address()``; "" unknown): the
    ``node`` label of its Prometheus series; several nodes may share one hostname (network namespaces)."""
    groups_delivered: int = 0
    """Groups it handed to the buffer so far (cumulative, whatever the buffer decided)."""
    gpus: tuple = ()
    """Its GPUs' utilization and memory (``moerl.runtime.gpu.GpuSample``; empty without a GPU)."""
    comm_errors: tuple[tuple[str, int], ...] = ()
    """Communication errors it caught, ``(kind, count)`` cumulative (``moerl.runtime.counters``)."""
    weight_sync_s: float | None = None
    """Seconds from the first bucket's offer of its current version to that version running in its
    engine (``runtime.weight_sync=object_store``; None: not measured)."""
    weight_bytes: int = 0
    """Bytes of weights it received for its current version."""
    weights_refused: int = 0
    """Weight versions it refused so far: a table or checksum that did not hold, or tensors that are not
    its engine's parameter set (``moerl.weights.sources.refused_versions_of``; cumulative)."""
    ep_size: int = 1
    """EP ranks of the worker (``rollout.ep_size``; > 1: an EP rollout group led by this worker)."""
    rank_pids: tuple[int, ...] = ()
    """Process ids of the group's EP ranks, rank order (empty for a one-rank worker)."""
    tokens_resumed: int = 0
    """Generated tokens it carried into continued sequences (``WorkerStats.tokens_resumed``; cumulative)."""
    tokens_discarded: int = 0
    """Generated tokens it threw away itself: aborts, drains or stops without prefixes (cumulative)."""
    tokens_snapshotted: int = 0
    """Tokens of its in-flight groups held at the exchange in its newest progress snapshots."""
    snapshot_bytes: int = 0
    """Bytes of progress snapshots it sent (``moerl.runtime.snapshots``; cumulative)."""
    ep_traffic: dict | None = None
    """EP bytes its group's ranks sent since it started, summed over the ranks: ``{"dispatch" | "combine":
    moerl.ep.Traffic}`` (``EPGroupEngine.ep_traffic``, cumulative); None for a one-rank worker."""


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """How a worker's run ended, as the backend observed it."""

    worker_id: str
    """The worker."""
    reason: str
    """``"drained"`` (after a notice), ``"stopped"`` (asked to stop) or ``"crashed"`` (died, error)."""
    drain: DrainReport | None = None
    """The drain's report (``reason == "drained"``)."""
    error: str | None = None
    """What killed it (``reason == "crashed"``)."""
    final: WorkerHealth | None = None
    """Its health at exit (a clean exit reports it; a crash cannot)."""


class WorkerBackend(Protocol):
    """Starts, watches and stops rollout workers for a ``FleetManager``."""

    def spawn(self, worker_id: str) -> None:
        """Start a worker; it loads the newest weight version before leasing. Must not block long."""

    def poll(self) -> tuple[dict[str, WorkerHealth], list[WorkerExit]]:
        """Health of the workers that answered a ping since the last poll, and the workers that exited."""

    def kill(self, worker_id: str) -> None:
        """Forcibly remove a worker that stopped answering (its late deliveries are fenced off)."""

    def notify(self, worker_id: str) -> None:
        """Give a worker a termination notice (it drains and exits)."""


@dataclass(slots=True)
class WorkerRecord:
    """What the manager knows about one worker."""

    worker_id: str
    """The worker's id (lease owner in the queue)."""
    spawned_at: float
    """Manager clock time of the spawn, in seconds."""
    state: WorkerState = WorkerState.STARTING
    """Where it is in its life."""
    last_seen: float = 0.0
    """Manager clock time of its last liveness answer (of the spawn before the first), in seconds."""
    health: WorkerHealth = field(default_factory=WorkerHealth)
    """Its last liveness answer."""
    replaces_since: float | None = None
    """When the loss this worker replaces was detected (None: not a replacement)."""
    tokens_lost: int = 0
    """Its generated tokens lost to interruptions, as the manager counts them (``FleetManager.tokens_lost``:
    drains without prefixes, a hard loss less what its progress snapshots kept)."""

    @property
    def tokens_discarded(self) -> int:
        """``rollout/tokens_discarded`` of this worker: ``tokens_lost`` plus what it discarded itself."""
        return self.tokens_lost + self.health.tokens_discarded


@dataclass(frozen=True, slots=True)
class ScalingHint:
    """Desired fleet size for an external autoscaler (logged every step)."""

    desired_workers: int
    """Workers wanted, within [min_workers, max_workers]."""
    ratio: float
    """Demand over supply that produced it (1 = the fleet keeps up exactly)."""


@dataclass(frozen=True, slots=True)
class FleetMetrics:
    """Fleet counters (cumulative over the run) for ``metrics.jsonl`` and ``summary.json``."""

    workers_alive: int
    """Workers answering pings now."""
    interruptions: int
    """Workers that went away unasked: drained + killed."""
    drained: int
    """Workers that exited cleanly after a termination notice."""
    killed: int
    """Workers that died or stopped answering."""
    spawned: int
    """Workers started over the run: the initial ones, replacements and newcomers."""
    replaced: int
    """Replacement workers that came up (answered a ping)."""
    tokens_generated: int
    """Response tokens generated by the fleet: delivered + discarded."""
    tokens_discarded: int
    """Generated tokens thrown away by interruptions (released without prefix, or died in flight and not
    in a progress snapshot); ``lost_work_tokens``."""
    time_to_replace_s: float | None
    """Mean seconds from detecting a loss to its replacement answering; None before any replacement."""
    replace_times_s: tuple[float, ...]
    """Each replacement's seconds from detecting the loss to its first answer, in order."""
    desired_workers: int
    """The latest scaling hint."""
    rollout_tokens_resumed: int = 0
    """``rollout/tokens_resumed``: generated tokens carried into continued sequences, over the workers."""
    rollout_tokens_discarded: int = 0
    """``rollout/tokens_discarded``: ``tokens_discarded`` plus the tokens workers threw away themselves
    (groups aborted for new weights, stops without prefixes)."""

    @property
    def lost_work_frac(self) -> float:
        """Generated tokens discarded / generated tokens (0 when nothing was generated)."""
        return self.tokens_discarded / self.tokens_generated if self.tokens_generated else 0.0

    def as_metrics(self) -> dict[str, float | int | None]:
        """The ``fleet/*`` entries of a ``metrics.jsonl`` record."""
        return {
            "fleet/workers_alive": self.workers_alive,
            "fleet/interruptions": self.interruptions,
            "fleet/drained": self.drained,
            "fleet/killed": self.killed,
            "fleet/lost_work_frac": self.lost_work_frac,
            "fleet/time_to_replace_s": self.time_to_replace_s,
            "fleet/desired_workers": self.desired_workers,
            "fleet/lost_work_tokens": self.tokens_discarded,
            "rollout/tokens_resumed": self.rollout_tokens_resumed,
            "rollout/tokens_discarded": self.rollout_tokens_discarded,
        }


class FleetManager:
    """Keeps between ``min_workers`` and ``max_workers`` rollout workers (module docstring).

    Args:
        backend: starts and watches the workers.
        num_workers: initial target size.
        min_workers: never fewer (replacements are spawned even with ``replace_dead=False``).
        max_workers: never more (``admit`` / ``scale_to`` beyond it are refused).
        heartbeat_timeout_s: an alive worker silent for this long is declared lost.
        startup_timeout_s: a starting worker silent for this long is declared lost.
        replace_dead: keep the target size by replacing lost and drained workers.
        clock: monotonic time in seconds; injectable in tests.
        id_prefix: worker ids are ``f"{id_prefix}-{n}"`` with n counting up, never reused.

    Raises:
        ValueError: ``not 0 <= min_workers <= num_workers <= max_workers`` or ``max_workers < 1``.
    """

    def __init__(
        self,
        backend: WorkerBackend,
        *,
        num_workers: int,
        min_workers: int = 1,
        max_workers: int | None = None,
        heartbeat_timeout_s: float = 30.0,
        startup_timeout_s: float = 300.0,
        replace_dead: bool = True,
        clock: Callable[[], float] = time.monotonic,
        id_prefix: str = "rollout",
    ):
        max_workers = num_workers if max_workers is None else max_workers
        if not 0 <= min_workers <= num_workers <= max_workers or max_workers < 1:
            raise ValueError(
                f"FleetManager: need 0 <= min_workers ({min_workers}) <= num_workers ({num_workers}) "
                f"<= max_workers ({max_workers}) and max_workers >= 1"
            )
        self.backend = backend
        self.target = num_workers
        self.min_workers, self.max_workers = min_workers, max_workers
        self.heartbeat_timeout_s, self.startup_timeout_s = heartbeat_timeout_s, startup_timeout_s
        self.replace_dead = replace_dead
        self.clock = clock
        self.id_prefix = id_prefix
        self.records: dict[str, WorkerRecord] = {}
        self._next_id = 0
        self._drained = self._killed = 0
        self._drain_lost: dict[str, int] = {}  # worker id -> tokens its drains released without prefix
        self._kill_loss: dict[
            str, tuple[int, int]
        ] = {}  # killed worker -> (in flight, snapshotted) at its last answer
        self._restored: dict[str, int] = {}  # killed worker -> tokens the queue restored from its snapshots
        self._replace_times: list[float] = []
        self._pending_losses: list[float] = []  # detection times of losses not yet replaced
        self._desired = num_workers
        self._retiring: set[str] = set()  # asked to drain by scale_to: not interruptions

    @classmethod
    def from_config(cls, fleet_cfg, num_workers: int, backend: WorkerBackend, **kwargs) -> FleetManager:
        """A manager sized by ``moerl.config.FleetConfig`` and ``rollout.num_workers``."""
        max_workers = fleet_cfg.max_workers if fleet_cfg.max_workers is not None else num_workers
        return cls(
            backend,
            num_workers=num_workers,
            min_workers=min(fleet_cfg.min_workers, num_workers),
            max_workers=max(max_workers, num_workers),
            heartbeat_timeout_s=fleet_cfg.heartbeat_timeout_s,
            replace_dead=fleet_cfg.replace_dead,
            **kwargs,
        )

    # -- membership --------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Spawn the initial ``num_workers`` workers; returns their ids."""
        return [self._spawn() for _ in range(self.target)]

    def _spawn(self, replaces_since: float | None = None) -> str:
        worker_id = f"{self.id_prefix}-{self._next_id}"
        self._next_id += 1
        now = self.clock()
        self.records[worker_id] = WorkerRecord(worker_id, now, last_seen=now, replaces_since=replaces_since)
        self.backend.spawn(worker_id)
        return worker_id

    def active_ids(self) -> list[str]:
        """Workers starting or alive."""
        return [r.worker_id for r in self.records.values() if r.state not in _GONE]

    def alive_ids(self) -> list[str]:
        """Workers that answered a ping and have not gone away."""
        return [r.worker_id for r in self.records.values() if r.state is WorkerState.ALIVE]

    def busy_ids(self) -> list[str]:
        """Alive workers whose last answer reported groups in flight (chaos picks its victims here)."""
        return [
            r.worker_id
            for r in self.records.values()
            if r.state is WorkerState.ALIVE and r.health.groups_in_flight > 0
        ]

    def admit(self) -> str | None:
        """Add one worker mid-run (raises the target by one); None if already at ``max_workers``."""
        if len(self.active_ids()) >= self.max_workers:
            return None
        self.target = min(self.max_workers, max(self.target, len(self.active_ids()) + 1))
        return self._spawn()

    def scale_to(self, num_workers: int) -> int:
        """Set the target size (clamped to [min_workers, max_workers]); spawns newcomers now, and gives
        the newest surplus workers a termination notice (they drain). Returns the new target."""
        self.target = max(self.min_workers, min(self.max_workers, num_workers))
        active = self.active_ids()
        for _ in range(self.target - len(active)):
            self._spawn()
        for worker_id in reversed(active[self.target :]):
            self._retiring.add(worker_id)
            self.backend.notify(worker_id)
        return self.target

    # -- the check -----------------------------------------------------------------------------

    def check(self) -> list[WorkerExit]:
        """Poll liveness and exits, declare silent workers lost, spawn replacements.

        Returns:
            The exits seen, including workers declared lost here (reason ``"crashed"``).
        """
        health, exits = self.backend.poll()
        exits = list(exits)
        now = self.clock()
        for worker_id, h in health.items():
            rec = self.records.get(worker_id)
            if rec is None or rec.state in _GONE:
                continue
            rec.last_seen, rec.health = now, h
            if rec.state is WorkerState.STARTING:
                rec.state = WorkerState.ALIVE
                if rec.replaces_since is not None:
                    self._replace_times.append(now - rec.replaces_since)
        for e in exits:
            self._on_exit(e, now)
        for rec in list(self.records.values()):
            timeout = (
                self.startup_timeout_s if rec.state is WorkerState.STARTING else self.heartbeat_timeout_s
            )
            if rec.state not in _GONE and now - rec.last_seen > timeout:
                self.backend.kill(rec.worker_id)
                lost = WorkerExit(rec.worker_id, "crashed", error=f"no liveness answer for {timeout:g} s")
                self._on_exit(lost, now)
                exits.append(lost)
        self._replace(now)
        return exits

    def finish(self, exits: list[WorkerExit]) -> None:
        """Record the exits of the end of the run (``backend`` stopped every worker); replaces nobody.
        A worker that died unseen just before the end is counted here."""
        now = self.clock()
        for e in exits:
            self._on_exit(e, now)

    def _on_exit(self, e: WorkerExit, now: float) -> None:
        rec = self.records.get(e.worker_id)
        if rec is None or rec.state in _GONE:
            return
        if e.final is not None:
            rec.health = e.final
        if e.drain is not None:
            self._drain_lost[e.worker_id] = self._drain_lost.get(e.worker_id, 0) + e.drain.tokens_discarded
        if e.reason in ("drained", "stopped") and e.worker_id in self._retiring:
            rec.state = WorkerState.STOPPED
            return
        if e.reason == "drained":
            rec.state = WorkerState.DRAINED
            self._drained += 1
        elif e.reason == "stopped":
            rec.state = WorkerState.STOPPED
            return
        else:
            rec.state = WorkerState.KILLED
            self._killed += 1
            self._kill_loss[e.worker_id] = (rec.health.tokens_in_flight, rec.health.tokens_snapshotted)
        rec.tokens_lost = self.tokens_lost(e.worker_id)
        self._pending_losses.append(now)

    def credit_restored(self, worker_id: str, tokens: int) -> None:
        """The queue restored ``tokens`` of a killed worker's progress snapshots to its requeued tasks
        (``TaskQueue.expire_worker``): they are continued, not lost."""
        self._restored[worker_id] = tokens
        if worker_id in self.records:
            self.records[worker_id].tokens_lost = self.tokens_lost(worker_id)

    @property
    def tokens_in_flight_at_losses(self) -> int:
        """Tokens the killed workers had in flight when lost, summed (what a hard loss would discard
        without progress snapshots): per worker the larger of its last answer's in-flight tokens and the
        tokens the queue restored from its snapshots (a last answer may be older than its last snapshot:
        an answer that timed out under load keeps the one before)."""
        return sum(
            max(in_flight, self._restored.get(worker_id, 0))
            for worker_id, (in_flight, _) in self._kill_loss.items()
        )

    def tokens_lost(self, worker_id: str) -> int:
        """Generated tokens of ``worker_id`` lost to interruptions: what its drains released without
        prefixes, plus, if it was killed, its in-flight tokens at its last answer less those the exchange
        held in its progress snapshots at that answer (once the queue confirmed the loss,
        ``credit_restored``): the un-snapshotted tail, an estimate from one instant (groups delivered
        meanwhile are not lost; tokens generated after the answer are)."""
        in_flight, snapshotted = self._kill_loss.get(worker_id, (0, 0))
        kept = snapshotted if worker_id in self._restored else 0  # both of one answer: the exchange held
        return self._drain_lost.get(worker_id, 0) + max(0, in_flight - kept)

    def _replace(self, now: float) -> None:
        want = self.target if self.replace_dead else self.min_workers
        while len(self.active_ids()) < want:
            since = self._pending_losses.pop(0) if self._pending_losses else now
            self._spawn(replaces_since=since)
        if len(self.active_ids()) >= want:
            self._pending_losses.clear()

    # -- outputs -------------------------------------------------------------------------------

    def scaling_hint(self, *, queue_pending: int, buffer_depth: int, batch_groups: int) -> ScalingHint:
        """Desired workers from queue and buffer depth, as a proportional rule in the style of the
        Kubernetes Horizontal Pod Autoscaler (``desired = ceil(current * demand / supply)``, no change
        within 10%):

            demand = batch_groups + queue_pending      (groups the trainer wants next + requeued backlog)
            supply = max(buffer_depth, 1)              (groups already waiting in the buffer)

        An empty buffer asks for more workers, a buffer holding several batches for fewer. The result
        is clamped to [min_workers, max_workers] and logged; it is a hint, nothing is scaled by it.
        """
        current = max(len(self.active_ids()), 1)
        ratio = (batch_groups + queue_pending) / max(buffer_depth, 1)
        desired = current if abs(ratio - 1.0) <= 0.1 else math.ceil(current * ratio)
        self._desired = max(self.min_workers, min(self.max_workers, desired))
        return ScalingHint(self._desired, ratio)

    def metrics(self) -> FleetMetrics:
        """Counters for the step's metrics record."""
        delivered = sum(r.health.tokens_delivered for r in self.records.values())
        lost = sum(r.tokens_lost for r in self.records.values())
        own = sum(r.health.tokens_discarded for r in self.records.values())
        times = self._replace_times
        return FleetMetrics(
            workers_alive=len(self.alive_ids()),
            interruptions=self._drained + self._killed,
            drained=self._drained,
            killed=self._killed,
            spawned=len(self.records),
            replaced=len(times),
            tokens_generated=delivered + lost,
            tokens_discarded=lost,
            rollout_tokens_resumed=sum(r.health.tokens_resumed for r in self.records.values()),
            rollout_tokens_discarded=lost + own,
            time_to_replace_s=sum(times) / len(times) if times else None,
            replace_times_s=tuple(times),
            desired_workers=self._desired,
        )
