"""The Prometheus endpoint of a run: per-worker rollout series, fleet and task accounting, trainer timings.

The driver owns one ``MetricsExporter``. Each trainer step it hands the exporter the workers' latest
heartbeat values (``WorkerSeries``) and the run's totals (``RunTotals``), and observes the step's
timings; a scrape renders whatever was handed last. Counters that other processes keep (tokens a
worker delivered, notices it received) are cumulative values that travel with the heartbeats, so
they are exported by a custom collector (prometheus_client's pattern for proxied counts) rather
than incremented here. A worker that went away keeps its last totals and ``moerl_worker_up 0``.

    exporter = MetricsExporter(max_staleness=2)
    with start_metrics_server(exporter, port=9464):      # raises MetricsPortError if taken
        exporter.update_workers({"w0": WorkerSeries(tokens_total=..., ...)})
        exporter.update_totals(RunTotals(...)); exporter.observe_step(step_s=..., weight_sync_s=...)

Series (``SERIES``; the alert rules and the Grafana dashboard use only these):
    moerl_rollout_tokens_total{worker}, moerl_rollout_groups_total{worker}   counters
    moerl_worker_up{worker}, moerl_worker_policy_lag{worker}                 gauges (lag in versions)
    moerl_spot_notices_total{worker}                                          counter
    moerl_tokens_resumed_total{worker}, moerl_tokens_discarded_total{worker}  counters (``rollout/tokens_*``)
    moerl_buffer_depth_groups, moerl_buffer_capacity_groups, moerl_queue_depth_tasks   gauges
    moerl_tasks_requeued_total, moerl_tasks_lost_total, moerl_tasks_duplicated_total   counters
    moerl_worker_kills_total, moerl_lost_work_tokens_total, moerl_trainer_wait_seconds_total counters
    moerl_trainer_step_seconds, moerl_weight_sync_seconds                     histograms
    moerl_policy_version, moerl_max_staleness                                gauges
    moerl_comm_errors_total{kind}                                             counter
    moerl_ep_bytes_total{link="intra|inter", direction="dispatch|combine"}   counter
    moerl_gpu_utilization_ratio{worker,gpu}, moerl_gpu_memory_used_bytes{worker,gpu},
    moerl_gpu_memory_total_bytes{worker,gpu}                                  gauges (NVML, when a GPU exists)
    learning (``LEARNING``, from each step's ``metrics.jsonl`` record, the last measured value held):
    moerl_trainer_step, moerl_reward_mean, moerl_reward_std, moerl_eval_accuracy, moerl_policy_loss,
    moerl_kl_ref, moerl_rollout_kl, moerl_entropy, moerl_grad_norm, moerl_learning_rate,
    moerl_response_length_mean, moerl_staleness_mean, moerl_staleness_max,
    moerl_rollout_tokens_per_second, moerl_train_tokens_per_second          gauges
    moerl_weights_refused_total                                               counter (``weights/refused_total``)
    moerl_reward_latency_seconds, moerl_reward_batch_size, moerl_reward_score_mean,
    moerl_reward_score_std                                                    gauges (a reward model's last step)
    moerl_reward_retries_total, moerl_reward_workers_lost_total               counters (with reward.model_path)
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moerl.configlib import ConfigError
from moerl.ep.layout import Traffic
from moerl.runtime.counters import COMM_ERROR_KINDS, comm_error_counts, count_comm_error  # noqa: F401 - re-exported
from moerl.runtime.gpu import GpuSample

LEARNING: dict[str, tuple[str, str]] = {
    "moerl_trainer_step": ("step", "The trainer step of the last record (1-based)."),
    "moerl_reward_mean": ("rollout/reward_mean", "Mean reward of the step's samples."),
    "moerl_reward_std": ("rollout/reward_std", "Standard deviation of the step's sample rewards."),
    "moerl_eval_accuracy": (
        "eval/accuracy",
        "Held-out accuracy at the last eval (metrics.jsonl eval/accuracy), 0-1.",
    ),
    "moerl_policy_loss": ("train/pg_loss", "Policy-gradient loss of the step."),
    "moerl_kl_ref": ("train/kl_ref", "KL(policy || reference) per loss token, nats (algorithm.kl_coef > 0)."),
    "moerl_rollout_kl": ("train/rollout_kl", "k3 KL(engine || trainer) per loss token, nats."),
    "moerl_entropy": ("train/entropy", "Mean token entropy of the policy, nats."),
    "moerl_grad_norm": ("train/grad_norm", "Global gradient norm before clipping."),
    "moerl_learning_rate": ("train/lr", "Learning rate of the step's optimizer updates."),
    "moerl_response_length_mean": ("rollout/response_len_mean", "Mean response length, tokens."),
    "moerl_staleness_mean": (
        "buffer/staleness_mean",
        "Mean trainer version minus group policy version over the batch, versions.",
    ),
    "moerl_staleness_max": ("buffer/staleness_max", "Max of the same, versions."),
    "moerl_rollout_tokens_per_second": (
        "perf/rollout_tokens_per_s",
        "Generated tokens per generation second.",
    ),
    "moerl_train_tokens_per_second": ("perf/train_tokens_per_s", "Trained tokens per train second."),
}
"""The learning series: gauge name -> (``metrics.jsonl`` key, help). Each holds the last value measured
(``eval/accuracy`` between evals, ``train/kl_ref`` only with a reference); absent until one was."""

SERIES: dict[str, str] = {
    "moerl_rollout_tokens_total": "counter",
    "moerl_rollout_groups_total": "counter",
    "moerl_worker_up": "gauge",
    "moerl_worker_policy_lag": "gauge",
    "moerl_spot_notices_total": "counter",
    "moerl_tokens_resumed_total": "counter",
    "moerl_tokens_discarded_total": "counter",
    "moerl_buffer_depth_groups": "gauge",
    "moerl_buffer_capacity_groups": "gauge",
    "moerl_queue_depth_tasks": "gauge",
    "moerl_tasks_requeued_total": "counter",
    "moerl_tasks_lost_total": "counter",
    "moerl_tasks_duplicated_total": "counter",
    "moerl_worker_kills_total": "counter",
    "moerl_lost_work_tokens_total": "counter",
    "moerl_trainer_wait_seconds_total": "counter",
    "moerl_trainer_step_seconds": "histogram",
    "moerl_weight_sync_seconds": "histogram",
    "moerl_policy_version": "gauge",
    "moerl_max_staleness": "gauge",
    "moerl_comm_errors_total": "counter",
    "moerl_ep_bytes_total": "counter",
    "moerl_gpu_utilization_ratio": "gauge",
    "moerl_gpu_memory_used_bytes": "gauge",
    "moerl_gpu_memory_total_bytes": "gauge",
    "moerl_weights_refused_total": "counter",
    **dict.fromkeys(LEARNING, "gauge"),
    "moerl_reward_latency_seconds": "gauge",
    "moerl_reward_batch_size": "gauge",
    "moerl_reward_score_mean": "gauge",
    "moerl_reward_score_std": "gauge",
    "moerl_reward_retries_total": "counter",
    "moerl_reward_workers_lost_total": "counter",
}
"""Every series the exporter defines, with its Prometheus type (the names are used by other checks)."""

log = logging.getLogger(__name__)

STEP_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Histogram buckets of ``moerl_trainer_step_seconds`` and ``moerl_weight_sync_seconds``, seconds."""


class MetricsPortError(ConfigError):
    """The metrics endpoint cannot listen on the requested address and port (in use, not allowed)."""


@dataclass(frozen=True, slots=True)
class WorkerSeries:
    """One rollout worker's values for the exporter, as its latest heartbeat carried them."""

    tokens_total: int = 0
    """Response tokens of the groups it delivered, cumulative."""
    groups_total: int = 0
    """Groups it delivered, cumulative."""
    policy_version: int = -1
    """Version of the weights in its engine (-1: none loaded yet)."""
    policy_lag: int | None = None
    """The trainer's version when this heartbeat was asked for minus ``policy_version`` (None: unknown)."""
    spot_notices_total: int = 0
    """Termination notices it received, cumulative (0 or 1 for one worker process)."""
    is_up: bool = True
    """It answers liveness pings."""
    gpus: tuple[GpuSample, ...] = ()
    """Its GPUs (empty without a GPU or without NVML)."""
    comm_errors: tuple[tuple[str, int], ...] = ()
    """Communication errors it caught, ``(kind, count)`` cumulative (``moerl.runtime.counters``)."""
    node: str = ""
    """The node it runs on (``WorkerHealth.node``: the Ray node's IP address; "" unknown), the ``node``
    label of its series."""
    tokens_resumed_total: int = 0
    """Generated tokens it carried into continued sequences, cumulative (``rollout/tokens_resumed``)."""
    tokens_discarded_total: int = 0
    """Its generated tokens thrown away, cumulative (``rollout/tokens_discarded``)."""


@dataclass(frozen=True, slots=True)
class RunTotals:
    """Driver-side values of the run, cumulative where named ``*_total``/``num_*``."""

    buffer_depth_groups: int = 0
    """Groups waiting in the experience buffer."""
    buffer_capacity_groups: int = 0
    """The buffer's bound (``runtime.buffer_groups``)."""
    queue_depth_tasks: int = 0
    """Tasks waiting in the task queue (pending, requeued ones included)."""
    num_requeued: int = 0
    """Tasks put back into the queue (lease expiry, release, staleness)."""
    num_lost: int = 0
    """Tasks that will never be trained (0 in a correct run: the exactly-once ledger's misses)."""
    num_duplicated: int = 0
    """Groups trained twice for one task (0 in a correct run)."""
    num_worker_kills: int = 0
    """Rollout workers that died or stopped answering."""
    lost_work_tokens: int = 0
    """Generated tokens discarded by interruptions."""
    trainer_wait_s: float = 0.0
    """Seconds the trainer waited for the buffer."""
    policy_version: int = 0
    """The trainer's weight version."""
    weights_refused: int = 0
    """Weight versions the rollout workers refused (``weights/refused_total``)."""
    reward_latency_s: float | None = None
    """Mean seconds per reward-model batch over the last step (None: none scored, or no reward model)."""
    reward_batch_size: float | None = None
    """Mean sequences per reward-model batch over the last step."""
    reward_score_mean: float | None = None
    """Mean raw reward-model score over the last step."""
    reward_score_std: float | None = None
    """Std of the same."""
    reward_retries: int | None = None
    """Reward batches scored again after a lost or timed-out reward worker (None: no reward model)."""
    reward_workers_lost: int | None = None
    """Reward workers that died or timed out and were replaced (None: no reward model)."""


@dataclass(slots=True)
class _State:
    workers: dict[str, WorkerSeries] = field(default_factory=dict)
    totals: RunTotals = field(default_factory=RunTotals)
    gpus: dict[str, tuple[GpuSample, ...]] = field(default_factory=dict)
    ep_bytes: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(link, d): 0 for link in ("intra", "inter") for d in ("dispatch", "combine")}
    )
    learning: dict[str, float] = field(default_factory=dict)


class MetricsExporter(Collector):
    """The run's series in a registry of their own (see the module docstring). Thread-safe.

    Args:
        max_staleness: ``runtime.max_staleness``, exported as ``moerl_max_staleness`` (the limit that the
            staleness alert compares ``moerl_worker_policy_lag`` with).
    """

    def __init__(self, *, max_staleness: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.max_staleness = int(max_staleness)
        self._lock = threading.Lock()
        self._state = _State()
        self._comm_base = comm_error_counts()  # this process's errors before the run are not the run's
        self._worker_source: Callable[[], Mapping[str, WorkerSeries]] | None = None
        self._source_failed = False
        self.registry.register(self)
        self.step_seconds = Histogram(
            "moerl_trainer_step_seconds",
            "Wall seconds of one trainer step (wait + train + publish + eval).",
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        )
        self.weight_sync_seconds = Histogram(
            "moerl_weight_sync_seconds",
            "Seconds to publish a weight version and offer it to the rollout workers.",
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        )

    # -- updates (driver) ----------------------------------------------------------------------

    def update_workers(self, workers: Mapping[str, WorkerSeries]) -> None:
        """Replace the per-worker values of the workers in ``workers``; others keep their last ones."""
        with self._lock:
            self._state.workers.update(workers)

    def set_worker_source(self, source: Callable[[], Mapping[str, WorkerSeries]] | None) -> None:
        """Read the per-worker values from ``source`` at each scrape (the fleet manager's latest
        heartbeats, fresher than the last step's ``update_workers``). ``source`` runs on the server's
        thread: it must only read. If it raises, the scrape serves the values handed last (logged once)."""
        self._worker_source = source

    def mark_down(self, worker_ids) -> None:
        """Export ``moerl_worker_up 0`` for these workers (gone: drained, killed, stopped)."""
        with self._lock:
            for wid in worker_ids:
                if (w := self._state.workers.get(wid)) is not None and w.is_up:
                    self._state.workers[wid] = _replace(w, is_up=False)

    def update_totals(self, totals: RunTotals) -> None:
        """Replace the run's totals (buffer, queue, task accounting, policy version)."""
        with self._lock:
            self._state.totals = totals

    def update_learning(self, record: Mapping) -> None:
        """Take the ``LEARNING`` values of a ``metrics.jsonl`` record; a key that is None or missing
        keeps its last value."""
        with self._lock:
            for name, (key, _) in LEARNING.items():
                if (value := record.get(key)) is not None:
                    self._state.learning[name] = float(value)

    def observe_step(self, *, step_s: float, weight_sync_s: float | None) -> None:
        """One trainer step's wall seconds, and its weight sync's (None: the step published nothing)."""
        self.step_seconds.observe(step_s)
        if weight_sync_s is not None:
            self.weight_sync_seconds.observe(weight_sync_s)

    def update_gpus(self, owner: str, gpus: tuple[GpuSample, ...]) -> None:
        """GPUs of a process that is not a rollout worker (``owner`` "trainer"), as ``moerl_gpu_*``."""
        with self._lock:
            self._state.gpus[owner] = tuple(gpus)

    @staticmethod
    def count_comm_error(kind: str, n: int = 1) -> None:
        """``moerl.runtime.counters.count_comm_error``: count errors of ``kind`` caught in this process.

        Raises:
            ValueError: unknown kind.
        """
        count_comm_error(kind, n)

    def add_ep_traffic(self, direction: str, traffic: Traffic) -> None:
        """Add the bytes of an EP ``dispatch`` or ``combine`` (``moerl.ep`` ``Traffic``, e.g. the
        difference of a dispatcher's ``total_traffic`` over a step) to ``moerl_ep_bytes_total``.

        Raises:
            ValueError: ``direction`` is not dispatch or combine, or the traffic is negative.
        """
        if direction not in ("dispatch", "combine"):
            raise ValueError(f"EP direction {direction!r}: expected dispatch or combine")
        if traffic.intra_node_bytes < 0 or traffic.inter_node_bytes < 0:
            raise ValueError(f"EP traffic must not be negative, got {traffic}")
        with self._lock:
            self._state.ep_bytes["intra", direction] += traffic.intra_node_bytes
            self._state.ep_bytes["inter", direction] += traffic.inter_node_bytes

    # -- scrape --------------------------------------------------------------------------------

    def collect(self) -> Iterator:
        """The series other than the histograms, from the values handed last (prometheus_client's
        ``Collector`` protocol; called on each scrape)."""
        if self._worker_source is not None:
            try:
                self.update_workers(self._worker_source())
            except Exception as e:  # a scrape must never fail the run
                if not self._source_failed:
                    log.warning(
                        "metrics: reading the workers' heartbeats failed (%r); serving the last values", e
                    )
                self._source_failed = True
        with self._lock:
            workers = dict(self._state.workers)
            totals = self._state.totals
            gpus = dict(self._state.gpus)
            ep = dict(self._state.ep_bytes)
            learning = dict(self._state.learning)
        comm = {k: n - self._comm_base[k] for k, n in comm_error_counts().items()}
        for w in workers.values():
            for kind, n in w.comm_errors:
                comm[kind] = comm.get(kind, 0) + n
        gpus.update({wid: w.gpus for wid, w in workers.items() if w.gpus})
        yield from _worker_families(workers)
        yield from _gpu_families(gpus)
        yield from _total_families(totals, self.max_staleness)
        for name, (_, doc) in LEARNING.items():
            family = GaugeMetricFamily(name, doc)
            if name in learning:
                family.add_metric([], learning[name])
            yield family
        errors = CounterMetricFamily(
            "moerl_comm_errors", "Collective timeouts and transport errors, where caught.", labels=["kind"]
        )
        for kind, n in sorted(comm.items()):
            errors.add_metric([kind], n)
        yield errors
        ep_bytes = CounterMetricFamily(
            "moerl_ep_bytes",
            "Bytes EP ranks sent to other ranks, by link class.",
            labels=["link", "direction"],
        )
        for (link, direction), n in sorted(ep.items()):
            ep_bytes.add_metric([link, direction], n)
        yield ep_bytes

    def render(self) -> bytes:
        """The exposition text a scrape returns."""
        return generate_latest(self.registry)


def _replace(w: WorkerSeries, **changes) -> WorkerSeries:
    values = {name: getattr(w, name) for name in WorkerSeries.__slots__}
    return WorkerSeries(**{**values, **changes})


WORKER_LABELS = ["worker", "node"]
"""Labels of every per-worker series: the worker's id and its node (``WorkerSeries.node``)."""


def _worker_families(workers: Mapping[str, WorkerSeries]) -> Iterator:
    tokens = CounterMetricFamily("moerl_rollout_tokens", "Response tokens delivered.", labels=WORKER_LABELS)
    groups = CounterMetricFamily("moerl_rollout_groups", "Groups delivered.", labels=WORKER_LABELS)
    up = GaugeMetricFamily("moerl_worker_up", "1 while the worker answers pings.", labels=WORKER_LABELS)
    lag = GaugeMetricFamily(
        "moerl_worker_policy_lag",
        "Trainer version when the worker's last heartbeat was asked for, minus its weights version.",
        labels=WORKER_LABELS,
    )
    notices = CounterMetricFamily("moerl_spot_notices", "Termination notices received.", labels=WORKER_LABELS)
    resumed = CounterMetricFamily(
        "moerl_tokens_resumed", "Generated tokens carried into continued sequences.", labels=WORKER_LABELS
    )
    discarded = CounterMetricFamily(
        "moerl_tokens_discarded", "Generated tokens thrown away (lost, aborted).", labels=WORKER_LABELS
    )
    for wid, w in sorted(workers.items()):
        resumed.add_metric([wid, w.node], w.tokens_resumed_total)
        discarded.add_metric([wid, w.node], w.tokens_discarded_total)
        tokens.add_metric([wid, w.node], w.tokens_total)
        groups.add_metric([wid, w.node], w.groups_total)
        up.add_metric([wid, w.node], 1.0 if w.is_up else 0.0)
        if w.policy_lag is not None:
            lag.add_metric([wid, w.node], w.policy_lag)
        notices.add_metric([wid, w.node], w.spot_notices_total)
    yield from (tokens, groups, up, lag, notices, resumed, discarded)


def _gpu_families(gpus: Mapping[str, tuple[GpuSample, ...]]) -> Iterator:
    labels = ["worker", "gpu"]
    util = GaugeMetricFamily("moerl_gpu_utilization_ratio", "NVML GPU utilization, 0-1.", labels=labels)
    used = GaugeMetricFamily("moerl_gpu_memory_used_bytes", "NVML GPU memory used.", labels=labels)
    total = GaugeMetricFamily("moerl_gpu_memory_total_bytes", "NVML GPU memory.", labels=labels)
    for owner, samples in sorted(gpus.items()):
        for g in samples:
            util.add_metric([owner, str(g.index)], g.utilization)
            used.add_metric([owner, str(g.index)], g.memory_used_bytes)
            total.add_metric([owner, str(g.index)], g.memory_total_bytes)
    yield from (util, used, total)


def _total_families(t: RunTotals, max_staleness: int) -> Iterator:
    gauges = (
        ("moerl_buffer_depth_groups", "Groups waiting in the experience buffer.", t.buffer_depth_groups),
        ("moerl_buffer_capacity_groups", "The experience buffer's bound.", t.buffer_capacity_groups),
        ("moerl_queue_depth_tasks", "Tasks waiting in the task queue.", t.queue_depth_tasks),
        ("moerl_policy_version", "The trainer's weight version.", t.policy_version),
        ("moerl_max_staleness", "runtime.max_staleness, versions.", max_staleness),
    )
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=value)
    counters = (
        ("moerl_tasks_requeued", "Tasks put back into the queue.", t.num_requeued),
        ("moerl_tasks_lost", "Tasks that will never be trained.", t.num_lost),
        ("moerl_tasks_duplicated", "Tasks trained more than once.", t.num_duplicated),
        ("moerl_worker_kills", "Rollout workers that died or stopped answering.", t.num_worker_kills),
        ("moerl_lost_work_tokens", "Generated tokens discarded by interruptions.", t.lost_work_tokens),
        ("moerl_trainer_wait_seconds", "Seconds the trainer waited for the buffer.", t.trainer_wait_s),
        ("moerl_weights_refused", "Weight versions the rollout workers refused.", t.weights_refused),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)
    yield from _reward_families(t)


def _reward_families(t: RunTotals) -> Iterator:
    """The reward model's series: gauges once a step scored something, counters when a model runs."""
    gauges = (
        (
            "moerl_reward_latency_seconds",
            "Mean seconds per reward-model batch, last step.",
            t.reward_latency_s,
        ),
        ("moerl_reward_batch_size", "Mean sequences per reward-model batch, last step.", t.reward_batch_size),
        ("moerl_reward_score_mean", "Mean raw reward-model score, last step.", t.reward_score_mean),
        ("moerl_reward_score_std", "Std of the raw reward-model scores, last step.", t.reward_score_std),
    )
    for name, doc, value in gauges:
        if value is not None:
            yield GaugeMetricFamily(name, doc, value=value)
    counters = (
        (
            "moerl_reward_retries",
            "Reward batches scored again after a lost or late worker.",
            t.reward_retries,
        ),
        ("moerl_reward_workers_lost", "Reward workers that died or timed out.", t.reward_workers_lost),
    )
    for name, doc, value in counters:
        if value is not None:
            yield CounterMetricFamily(name, doc, value=value)


class MetricsServer:
    """A running endpoint (``start_metrics_server``); ``close()`` stops it and frees the port."""

    def __init__(self, httpd, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.address, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        """``http://address:port/metrics``."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, close the listening socket and join the server thread (idempotent)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
        self._httpd = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_metrics_server(
    exporter: MetricsExporter, *, port: int, address: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``exporter`` at ``http://address:port/metrics`` from a daemon thread.

    Args:
        port: TCP port (1-65535).
        address: interface to bind; ``127.0.0.1`` keeps the endpoint local, ``0.0.0.0`` exposes it.

    Raises:
        MetricsPortError: the port is taken or the address cannot be bound (one line, before training).
    """
    try:
        httpd, thread = start_http_server(port, addr=address, registry=exporter.registry)
    except OSError as e:
        why = "already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise MetricsPortError(
            f"--metrics-port {port}: cannot serve metrics on {address}:{port} ({why}); "
            "pick another port or 0 to turn the endpoint off"
        ) from e
    return MetricsServer(httpd, thread)
