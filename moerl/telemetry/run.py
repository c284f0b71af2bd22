"""Everything one run reports, behind one object the controller calls once a step.

    telemetry = RunTelemetry.start(cfg, run_path, metrics_path)   # endpoint first: a taken port fails here
    record = telemetry.write_step(step, wall_s, values, groups=..., workers=..., queue=..., buffer=...)
    telemetry.close()                                              # endpoint gone, loggers flushed

``write_step`` adds the per-worker record (``rollout/workers``: rates since the previous record from
the totals the workers' heartbeats carry), notices, lost work and EP bytes to the step's values,
writes ``metrics.jsonl``, sends the record to the configured loggers (TensorBoard, W&B) and updates
the Prometheus exporter. EP traffic (``moerl.ep``'s ``Traffic``, bytes sent to other ranks, summed over
ranks) comes from two places: the sharded trainer's step, handed in by the controller through
``add_ep_traffic`` (``TrainerGroup.last_ep_traffic``), and the EP rollout groups, whose leaders' heartbeats
carry their group's cumulative bytes (``WorkerHealth.ep_traffic``): ``write_step`` adds each worker's
growth since the previous record.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from moerl.config import RunConfig, to_dict
from moerl.ep.layout import Traffic
from moerl.ep.traffic import DirectionTraffic, traffic_delta
from moerl.records import Group
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.fleet import WorkerRecord, WorkerState
from moerl.runtime.gpu import read_gpus
from moerl.runtime.queue import QueueStats
from moerl.telemetry.loggers import Loggers
from moerl.telemetry.metrics import WORKERS_KEY, MetricsWriter
from moerl.telemetry.prometheus import (
    MetricsExporter,
    MetricsServer,
    RunTotals,
    WorkerSeries,
    start_metrics_server,
)

RATE_WINDOW_S = 10.0
"""Trailing window of the per-worker rates in ``metrics.jsonl`` (seconds of run wall time)."""


def worker_series(rec: WorkerRecord, policy_lag: int | None) -> WorkerSeries:
    """The exporter's view of one worker from the fleet manager's record of its last heartbeat, with its
    policy lag (``Rollouts.policy_lags``; None: not known yet)."""
    h = rec.health
    return WorkerSeries(
        tokens_total=h.tokens_delivered,
        groups_total=h.groups_delivered,
        policy_version=h.policy_version,
        policy_lag=policy_lag,
        spot_notices_total=int(h.is_draining or rec.state is WorkerState.DRAINED),
        is_up=rec.state is WorkerState.ALIVE,
        gpus=h.gpus,
        comm_errors=h.comm_errors,
        node=h.node,
        tokens_resumed_total=h.tokens_resumed,
        tokens_discarded_total=rec.tokens_discarded,
    )


def tasks_lost(queue: QueueStats, buffer: BufferMetrics, num_trained: int) -> int:
    """Drawn tasks in none of the places a task can be, from counters only (``moerl.runtime.setup.
    accounting`` is the exact end-of-run figure from the task ids):

        lost = cursor - (trained + pending + leased + buffered + filtered + dropped stale)

    A task in transit between queue and buffer can be counted twice, never zero times (the buffer
    settles a group in the queue and stores it under its lock), so this never reports a false loss."""
    accounted = (
        num_trained + queue.pending + queue.outstanding + buffer.depth + queue.filtered + buffer.dropped_stale
    )
    return max(0, queue.cursor - accounted)


class RunTelemetry:
    """``metrics.jsonl``, the loggers of ``telemetry.loggers`` and the Prometheus endpoint of one run.

    Args:
        cfg: the run config (``telemetry``, ``runtime.max_staleness``, ``runtime.buffer_groups``).
        run_path: the run folder (TensorBoard and W&B files go below it).
        metrics_path: the ``metrics.jsonl`` file.
        trained_task_ids: task ids in the ledger already (a resumed run).
    """

    def __init__(
        self, cfg: RunConfig, run_path: str | Path, metrics_path: str | Path, trained_task_ids: Iterable = ()
    ) -> None:
        self.cfg = cfg
        self.metrics = MetricsWriter(metrics_path)
        self.exporter = MetricsExporter(max_staleness=cfg.runtime.max_staleness)
        self.server: MetricsServer | None = None
        self.loggers: Loggers | None = None
        self._trained: Counter = Counter(trained_task_ids)
        self._history: dict[str, deque] = {}  # worker -> (wall_s, tokens, groups) over RATE_WINDOW_S
        self._wait_s = 0.0
        self._ep: Traffic | None = None
        self._worker_ep: dict[str, DirectionTraffic] = {}  # worker -> its EP group's bytes at the last record

    @classmethod
    def start(
        cls, cfg: RunConfig, run_path: str | Path, metrics_path: str | Path, trained_task_ids: Iterable = ()
    ) -> RunTelemetry:
        """Open the endpoint (``telemetry.metrics_port`` > 0) and the loggers, in that order.

        Raises:
            MetricsPortError: the port is taken or the address cannot be bound (a ``ConfigError``).
            ConfigError: a configured logger's package is not installed.
        """
        self = cls(cfg, run_path, metrics_path, trained_task_ids)
        t = cfg.telemetry
        try:
            if t.metrics_port:
                self.server = start_metrics_server(
                    self.exporter, port=t.metrics_port, address=t.metrics_address
                )
            self.loggers = Loggers(t, run_path, to_dict(cfg))
        except BaseException:
            self.close()
            raise
        return self

    @property
    def url(self) -> str | None:
        """The endpoint's URL (None: off)."""
        return self.server.url if self.server is not None else None

    def watch_fleet(self, fleet) -> None:
        """Serve the fleet's latest heartbeats at each scrape (``fleet.worker_records()``, read-only),
        between steps too; ``None`` stops it (before the fleet is closed)."""
        if fleet is None:
            self.exporter.set_worker_source(None)
            return

        def series() -> dict[str, WorkerSeries]:
            lags = fleet.policy_lags()
            return {r.worker_id: worker_series(r, lags.get(r.worker_id)) for r in fleet.worker_records()}

        self.exporter.set_worker_source(series)

    def reload_ledger(self, trained_task_ids: Iterable) -> None:
        """Start the trained-task count again from the ledger (after a trainer restart rewound it)."""
        self._trained = Counter(trained_task_ids)

    def carry_ep_totals(self, records: Sequence[Mapping]) -> None:
        """Start the cumulative ``ep/*`` keys from the newest of a resumed run's kept ``records`` (those of
        ``metrics.jsonl`` up to the checkpoint's step) that has them, not from zero. The endpoint's
        ``moerl_ep_bytes_total`` restarts with the process, as Prometheus counters do."""
        for rec in reversed(records):
            intra, inter = rec.get("ep/intra_node_bytes"), rec.get("ep/inter_node_bytes")
            if intra is not None and inter is not None:
                self._ep = Traffic(intra_node_bytes=int(intra), inter_node_bytes=int(inter))
                return

    def add_ep_traffic(self, direction: str, traffic: Traffic) -> None:
        """EP bytes of a ``dispatch`` or ``combine`` (``moerl.ep.Traffic``): to the exporter's
        ``moerl_ep_bytes_total`` and to the ``ep/*`` keys of the next records."""
        self.exporter.add_ep_traffic(direction, traffic)
        self._ep = traffic if self._ep is None else self._ep + traffic

    def write_step(
        self,
        step: int,
        wall_s: float,
        values: dict,
        *,
        groups: Sequence[Group],
        workers: Iterable[WorkerRecord],
        lags: Mapping[str, int],
        queue: QueueStats,
        buffer: BufferMetrics,
        step_s: float,
        weight_sync_s: float | None,
    ) -> dict:
        """Complete, write and report one step's record; returns it (``MetricsWriter.write``).

        Args:
            values: the step's ``METRIC_KEYS`` values so far (``step_values`` + ``fleet_values``).
            groups: the batch trained in this step (their task ids count as trained).
            workers: the fleet manager's records (last heartbeat of every worker seen).
            lags: worker id -> policy lag (``Rollouts.policy_lags``), against the trainer's version when
                each answer was asked for, not this step's (an answer a second old would read as a lag
                of every step since).
            queue, buffer: the step's queue and buffer counters.
            step_s: the step's wall seconds; weight_sync_s: its publication's (None: nothing published).
        """
        self._trained.update(g.task_id for g in groups)
        self._wait_s += values.get("timing/wait_s") or 0.0
        workers = list(workers)
        self._add_worker_ep(workers)
        series = {rec.worker_id: worker_series(rec, lags.get(rec.worker_id)) for rec in workers}
        values = {
            **values,
            WORKERS_KEY: self._worker_entries(wall_s, series),
            "fleet/spot_notices": sum(w.spot_notices_total for w in series.values()),
        }
        values.setdefault("fleet/lost_work_tokens", 0)
        if self._ep is not None:
            values["ep/intra_node_bytes"] = self._ep.intra_node_bytes
            values["ep/inter_node_bytes"] = self._ep.inter_node_bytes
        record = self.metrics.write(step, wall_s, values)
        self._export(record, series, queue, buffer, step_s, weight_sync_s)
        if self.loggers is not None:
            self.loggers.log(record)
        return record

    def _add_worker_ep(self, workers: Sequence[WorkerRecord]) -> None:
        """The EP rollout groups' bytes since the previous record, from their heartbeats' cumulative totals
        (a worker seen again after its counters restarted, a new incarnation under the same id, counts
        from zero)."""
        for rec in workers:
            now = rec.health.ep_traffic
            if now is None:
                continue
            try:
                grown = traffic_delta(now, self._worker_ep.get(rec.worker_id))
            except ValueError:  # a new incarnation under the same id: its counters started again
                grown = now
            self._worker_ep[rec.worker_id] = now
            for direction, traffic in grown.items():
                self.add_ep_traffic(direction, traffic)

    def _worker_entries(self, wall_s: float, series: Mapping[str, WorkerSeries]) -> dict:
        """Per-worker fields; rates over the trailing ``RATE_WINDOW_S`` (heartbeats move the totals
        about once a second, so a rate between two close records would be mostly 0 or a spike)."""
        entries = {}
        for wid, w in series.items():
            history = self._history.setdefault(wid, deque())
            while len(history) > 1 and wall_s - history[1][0] >= RATE_WINDOW_S:
                history.popleft()  # keep one point at least RATE_WINDOW_S old
            first = history[0] if history else None
            dt = wall_s - first[0] if first is not None else 0.0
            entries[wid] = {
                "tokens_per_s": (w.tokens_total - first[1]) / dt if dt > 0 else None,
                "groups_per_s": (w.groups_total - first[2]) / dt if dt > 0 else None,
                "tokens_total": w.tokens_total,
                "groups_total": w.groups_total,
                "policy_lag": w.policy_lag,
                "spot_notices": w.spot_notices_total,
                "is_up": int(w.is_up),
                "tokens_resumed": w.tokens_resumed_total,
                "tokens_discarded": w.tokens_discarded_total,
            }
            history.append((wall_s, w.tokens_total, w.groups_total))
        return entries

    def _export(self, record: dict, series, queue: QueueStats, buffer: BufferMetrics, step_s, weight_sync_s):
        duplicated = sum(n - 1 for n in self._trained.values())
        self.exporter.update_workers(series)
        self.exporter.update_totals(
            RunTotals(
                buffer_depth_groups=buffer.depth,
                buffer_capacity_groups=buffer.capacity,
                queue_depth_tasks=queue.pending,
                num_requeued=queue.requeued,
                num_lost=tasks_lost(queue, buffer, len(self._trained)),
                num_duplicated=duplicated,
                num_worker_kills=int(record.get("fleet/killed") or 0),
                lost_work_tokens=int(record.get("fleet/lost_work_tokens") or 0),
                trainer_wait_s=self._wait_s,
                policy_version=int(record.get("policy_version") or 0),
                weights_refused=int(record.get("weights/refused_total") or 0),
                **_reward_totals(record),
            )
        )
        self.exporter.update_learning(record)
        self.exporter.observe_step(step_s=step_s, weight_sync_s=weight_sync_s)
        if self.cfg.model.device.startswith("cuda"):
            self.exporter.update_gpus("trainer", read_gpus())

    def close(self) -> None:
        """Stop the endpoint (its port is free afterwards) and close the loggers (idempotent)."""
        self.exporter.set_worker_source(None)
        if self.server is not None:
            self.server.close()
        if self.loggers is not None:
            self.loggers.close()


def _reward_totals(record: dict) -> dict:
    """``RunTotals`` reward fields from a metrics record's ``reward/*`` values (None where absent)."""

    def count(key: str) -> int | None:
        return None if record.get(key) is None else int(record[key])

    return {
        "reward_latency_s": record.get("reward/latency_s"),
        "reward_batch_size": record.get("reward/batch_size"),
        "reward_score_mean": record.get("reward/score_mean"),
        "reward_score_std": record.get("reward/score_std"),
        "reward_retries": count("reward/retries"),
        "reward_workers_lost": count("reward/workers_lost"),
    }
