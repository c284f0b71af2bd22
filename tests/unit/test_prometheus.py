"""The Prometheus exporter: every defined series is served, values come from heartbeats and totals, the
endpoint frees its port on close, a taken port is a one-line error."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moerl.config import ConfigError
from moerl.ep.layout import Traffic
from moerl.runtime.counters import classify_comm_error, count_comm_error
from moerl.runtime.gpu import GpuSample, read_gpus
from moerl.telemetry.prometheus import (
    SERIES,
    MetricsExporter,
    MetricsPortError,
    RunTotals,
    WorkerSeries,
    start_metrics_server,
)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _exporter() -> MetricsExporter:
    e = MetricsExporter(max_staleness=2)
    gpu = GpuSample(index=3, utilization=0.5, memory_used_bytes=1 << 30, memory_total_bytes=8 << 30)
    e.update_workers(
        {
            # rollout-0's heartbeat was asked for at version 6 (policy_lag 2); rollout-1's at version 6 too
            "rollout-0": WorkerSeries(
                tokens_total=640, groups_total=5, policy_version=4, policy_lag=2, gpus=(gpu,), node="10.0.0.7"
            ),
            "rollout-1": WorkerSeries(
                tokens_total=320,
                node="10.0.0.8",
                groups_total=2,
                policy_version=6,
                policy_lag=0,
                spot_notices_total=1,
                comm_errors=(("timeout", 2), ("rpc", 1)),
            ),
        }
    )
    e.update_totals(
        RunTotals(
            buffer_depth_groups=7,
            buffer_capacity_groups=32,
            queue_depth_tasks=11,
            num_requeued=3,
            num_worker_kills=1,
            lost_work_tokens=96,
            trainer_wait_s=2.5,
            policy_version=6,
            reward_latency_s=0.25,
            reward_batch_size=16.0,
            reward_score_mean=1.5,
            reward_score_std=0.5,
            reward_retries=2,
            reward_workers_lost=1,
        )
    )
    e.observe_step(step_s=0.3, weight_sync_s=0.02)
    e.observe_step(step_s=3.0, weight_sync_s=None)
    e.add_ep_traffic("dispatch", Traffic(intra_node_bytes=1000, inter_node_bytes=24))
    e.add_ep_traffic("combine", Traffic(intra_node_bytes=500, inter_node_bytes=12))
    e.add_ep_traffic("dispatch", Traffic(intra_node_bytes=1, inter_node_bytes=1))
    e.count_comm_error("timeout")  # caught in the driver
    e.update_gpus(
        "trainer", (GpuSample(index=0, utilization=1.0, memory_used_bytes=5, memory_total_bytes=9),)
    )
    return e


def test_every_series_is_exposed_with_its_type():
    fams = {f.name: f.type for f in text_string_to_metric_families(_exporter().render().decode())}
    # the parser names counter families without _total
    exposed = {(name + "_total" if kind == "counter" else name): kind for name, kind in fams.items()}
    exposed = {k: v for k, v in exposed.items() if not k.endswith("_created")}  # histogram creation times
    assert exposed == SERIES


def test_values_come_from_heartbeats_and_totals():
    s = _samples(_exporter().render().decode())
    # every worker series carries the node the worker runs on
    w0, w1 = (("node", "10.0.0.7"), ("worker", "rollout-0")), (("node", "10.0.0.8"), ("worker", "rollout-1"))
    assert s["moerl_rollout_tokens_total", w0] == 640 and s["moerl_rollout_tokens_total", w1] == 320
    assert s["moerl_rollout_groups_total", w0] == 5
    assert s["moerl_worker_policy_lag", w0] == 2 and s["moerl_worker_policy_lag", w1] == 0
    assert s["moerl_spot_notices_total", w1] == 1 and s["moerl_worker_up", w0] == 1
    assert s["moerl_buffer_depth_groups", ()] == 7 and s["moerl_queue_depth_tasks", ()] == 11
    assert s["moerl_tasks_requeued_total", ()] == 3 and s["moerl_worker_kills_total", ()] == 1
    assert s["moerl_lost_work_tokens_total", ()] == 96 and s["moerl_trainer_wait_seconds_total", ()] == 2.5
    assert s["moerl_policy_version", ()] == 6 and s["moerl_max_staleness", ()] == 2
    assert s["moerl_trainer_step_seconds_count", ()] == 2 and s["moerl_trainer_step_seconds_sum", ()] == 3.3
    assert s["moerl_trainer_step_seconds_bucket", (("le", "0.5"),)] == 1
    assert s["moerl_weight_sync_seconds_count", ()] == 1
    assert s["moerl_comm_errors_total", (("kind", "timeout"),)] == 3  # driver + rollout-1's heartbeat
    assert s["moerl_comm_errors_total", (("kind", "rpc"),)] == 1
    assert s["moerl_comm_errors_total", (("kind", "transport"),)] == 0  # exported from 0
    assert s["moerl_ep_bytes_total", (("direction", "dispatch"), ("link", "intra"))] == 1001
    assert s["moerl_ep_bytes_total", (("direction", "combine"), ("link", "inter"))] == 12
    g = (("gpu", "3"), ("worker", "rollout-0"))
    assert s["moerl_gpu_utilization_ratio", g] == 0.5 and s["moerl_gpu_memory_total_bytes", g] == 8 << 30
    assert s["moerl_gpu_memory_used_bytes", (("gpu", "0"), ("worker", "trainer"))] == 5


def test_comm_errors_count_from_the_exporters_start():
    count_comm_error("transport")  # before the run: not the run's
    e = MetricsExporter()
    count_comm_error("transport")
    s = _samples(e.render().decode())
    assert s["moerl_comm_errors_total", (("kind", "transport"),)] == 1


def test_classify_comm_error():
    import torch.distributed as dist

    assert classify_comm_error(TimeoutError("x")) == "timeout"
    assert classify_comm_error(dist.DistError("Socket Timeout")) == "timeout"
    assert classify_comm_error(dist.DistBackendError("NCCL error: unhandled system error")) == "transport"
    assert classify_comm_error(RuntimeError("object lost")) == "rpc"


def test_gone_worker_keeps_its_totals_and_is_down():
    e = _exporter()
    e.mark_down(["rollout-1"])
    e.update_workers({"rollout-2": WorkerSeries(tokens_total=10, groups_total=1, policy_version=6)})
    s = _samples(e.render().decode())
    assert s["moerl_worker_up", (("node", "10.0.0.8"), ("worker", "rollout-1"))] == 0
    assert s["moerl_rollout_tokens_total", (("node", "10.0.0.8"), ("worker", "rollout-1"))] == 320
    assert s["moerl_worker_up", (("node", ""), ("worker", "rollout-2"))] == 1


def test_bad_inputs_are_refused():
    e = MetricsExporter()
    with pytest.raises(ValueError, match="comm error kind"):
        e.count_comm_error("nccl")
    with pytest.raises(ValueError, match="direction"):
        e.add_ep_traffic("forward", Traffic())
    with pytest.raises(ValueError, match="negative"):
        e.add_ep_traffic("dispatch", Traffic(intra_node_bytes=-1))


def test_server_answers_then_frees_its_port():
    e = _exporter()
    server = start_metrics_server(e, port=0)  # 0: an ephemeral port for the test
    assert server.address == "127.0.0.1"
    body = urllib.request.urlopen(server.url, timeout=5).read().decode()
    assert 'moerl_rollout_tokens_total{node="10.0.0.7",worker="rollout-0"} 640.0' in body
    port = server.port
    server.close()
    server.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    start_metrics_server(e, port=port).close()  # the port is free again (a rerun can take it)


def test_port_in_use_is_a_clear_config_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"{port}.*already in use") as info:
            start_metrics_server(MetricsExporter(), port=port)
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one line, exit 2


def test_no_gpu_reads_as_empty(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert read_gpus() == ()


def test_nvml_readings_follow_cuda_visible_devices(monkeypatch):
    import sys
    import types

    class NVMLError(Exception):
        pass

    mem = types.SimpleNamespace(used=3 << 30, total=80 << 30)
    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 8,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: mem,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=10 * h),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert read_gpus() == (GpuSample(2, 0.2, 3 << 30, 80 << 30), GpuSample(5, 0.5, 3 << 30, 80 << 30))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert len(read_gpus()) == 8

    def no_driver():
        raise NVMLError("Driver Not Loaded")

    fake.nvmlInit = no_driver
    assert read_gpus() == ()


def test_learning_series_come_from_the_step_records_and_hold_the_last_measured_value():
    from moerl.telemetry.metrics import make_record
    from moerl.telemetry.prometheus import LEARNING

    e = MetricsExporter()
    first = {"rollout/reward_mean": 0.25, "eval/accuracy": 0.5, "train/pg_loss": -0.1, "train/kl_ref": 0.02,
             "buffer/staleness_mean": 0.5, "buffer/staleness_max": 1, "weights/refused_total": 1}  # fmt: skip
    e.update_learning(make_record(1, 1.0, first))
    e.update_learning(make_record(2, 2.0, {"rollout/reward_mean": 0.75, "train/pg_loss": 0.3}))
    e.update_totals(RunTotals(weights_refused=1))
    s = _samples(e.render().decode())
    assert s["moerl_trainer_step", ()] == 2 and s["moerl_reward_mean", ()] == 0.75
    assert s["moerl_policy_loss", ()] == 0.3 and s["moerl_kl_ref", ()] == 0.02
    assert s["moerl_eval_accuracy", ()] == 0.5  # measured at step 1, held between evals
    assert s["moerl_staleness_mean", ()] == 0.5 and s["moerl_staleness_max", ()] == 1
    assert s["moerl_weights_refused_total", ()] == 1
    assert ("moerl_rollout_kl", ()) not in s  # never measured: no sample
    assert set(LEARNING) <= set(SERIES)


def test_reward_series_come_from_the_totals_and_only_with_a_reward_model():
    s = _samples(_exporter().render().decode())
    assert s["moerl_reward_latency_seconds", ()] == 0.25 and s["moerl_reward_batch_size", ()] == 16
    assert s["moerl_reward_score_mean", ()] == 1.5 and s["moerl_reward_score_std", ()] == 0.5
    assert s["moerl_reward_retries_total", ()] == 2 and s["moerl_reward_workers_lost_total", ()] == 1
    e = MetricsExporter()
    e.update_totals(RunTotals(policy_version=1))
    text = e.render().decode()
    assert not any(
        f"moerl_reward_{k}" in text for k in ("latency", "batch_size", "score", "retries", "workers_lost")
    )
