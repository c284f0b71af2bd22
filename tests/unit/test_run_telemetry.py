"""RunTelemetry: one call a step writes metrics.jsonl with the per-worker record and updates the exporter."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from moerl.config import load_config
from moerl.ep.layout import Traffic
from moerl.runtime.buffer import BufferMetrics
from moerl.runtime.fleet import WorkerHealth, WorkerRecord, WorkerState
from moerl.runtime.queue import QueueStats
from moerl.telemetry.run import RunTelemetry, tasks_lost


def _queue(**kw) -> QueueStats:
    base = dict(leased=0, acked=0, filtered=0, dropped_stale=0, requeued=0, released=0, expired=0)
    base |= dict(requeued_stale=0, refused=0, outstanding=0, pending=0, cursor=0, is_exhausted=False)
    return QueueStats(**(base | kw))


def _buffer(**kw) -> BufferMetrics:
    base = dict(depth=0, capacity=8, version=0, staleness_mean=0.0, staleness_max=0, admitted=0)
    base |= dict(delivered=0, filtered=0, filtered_by={}, dropped_stale=0, requeued_stale=0)
    base |= dict(refused_stale_token=0, put_timeouts=0, put_wait_s=0.0, get_wait_s=0.0)
    return BufferMetrics(**(base | kw))


def _rec(wid: str, tokens: int, groups: int, version: int, state=WorkerState.ALIVE, draining=False):
    health = WorkerHealth(
        tokens_delivered=tokens,
        groups_delivered=groups,
        policy_version=version,
        is_draining=draining,
        node=f"10.0.0.{wid[-1]}",  # the worker's node reaches its series' `node` label
    )
    return WorkerRecord(wid, 0.0, state, health=health)


def _samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_lost_tasks_from_counters():
    # 10 drawn = 3 trained + 2 pending + 1 leased + 2 buffered + 1 filtered + 1 dropped: none lost
    q, b = _queue(cursor=10, pending=2, outstanding=1, filtered=1), _buffer(depth=2, dropped_stale=1)
    assert tasks_lost(q, b, num_trained=3) == 0
    assert tasks_lost(q, b, num_trained=1) == 2
    assert tasks_lost(q, b, num_trained=5) == 0  # double counts in transit never read as a loss


def test_write_step_records_workers_and_feeds_the_exporter(tmp_path):
    cfg = load_config(None, ["telemetry.metrics_port=0", "runtime.max_staleness=2"])
    t = RunTelemetry.start(cfg, tmp_path, tmp_path / "metrics.jsonl")
    groups = [SimpleNamespace(task_id="a"), SimpleNamespace(task_id="b")]
    common = dict(step_s=0.5, weight_sync_s=0.1)
    t.write_step(
        1,
        10.0,
        {"policy_version": 1, "timing/wait_s": 2.0, "fleet/killed": 0},
        groups=groups,
        workers=[_rec("rollout-0", 100, 2, 1), _rec("rollout-1", 50, 1, 0)],
        lags={"rollout-0": 0, "rollout-1": 1},
        queue=_queue(cursor=4, pending=2, requeued=1),
        buffer=_buffer(depth=0),
        **common,
    )
    gone = _rec("rollout-1", 80, 2, 1, state=WorkerState.DRAINED, draining=True)
    record = t.write_step(
        2,
        12.0,
        # the trainer is at version 9 by now, but rollout-0's heartbeat was asked for at version 2, when its
        # engine was at 2: its lag is 0, not 9 - 2 (the lags come from Rollouts.policy_lags)
        {"policy_version": 9, "timing/wait_s": 1.0, "fleet/killed": 0, "fleet/lost_work_tokens": 16},
        groups=[SimpleNamespace(task_id="a")],  # trained again: a duplicate
        workers=[_rec("rollout-0", 300, 6, 2), gone],
        lags={"rollout-0": 0, "rollout-1": 1},
        queue=_queue(cursor=5, pending=1, requeued=1),
        buffer=_buffer(depth=1),
        **common,
    )
    w0, w1 = record["rollout/workers"]["rollout-0"], record["rollout/workers"]["rollout-1"]
    assert w0 == {
        "tokens_per_s": 100.0,  # (300 - 100) tokens / (12 - 10) s
        "groups_per_s": 2.0,
        "tokens_total": 300,
        "groups_total": 6,
        "policy_lag": 0,
        "spot_notices": 0,
        "is_up": 1,
        "tokens_resumed": 0,
        "tokens_discarded": 0,
    }
    assert (
        w1["tokens_per_s"] == 15.0 and w1["is_up"] == 0 and w1["spot_notices"] == 1 and w1["policy_lag"] == 1
    )
    assert record["fleet/spot_notices"] == 1 and record["fleet/lost_work_tokens"] == 16
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["rollout/workers"]["rollout-0"]["tokens_per_s"] is None  # no previous record
    s = _samples(t.exporter.render().decode())
    assert s["moerl_rollout_tokens_total", (("node", "10.0.0.0"), ("worker", "rollout-0"))] == 300
    assert s["moerl_worker_up", (("node", "10.0.0.1"), ("worker", "rollout-1"))] == 0
    assert s["moerl_trainer_wait_seconds_total", ()] == 3.0
    assert s["moerl_tasks_duplicated_total", ()] == 1
    assert s["moerl_tasks_lost_total", ()] == 1  # 5 drawn - (2 distinct trained + 1 pending + 1 buffered)
    assert s["moerl_buffer_capacity_groups", ()] == 8 and s["moerl_lost_work_tokens_total", ()] == 16
    assert s["moerl_trainer_step_seconds_count", ()] == 2 and s["moerl_weight_sync_seconds_count", ()] == 2
    t.close()


def test_scrapes_read_the_fleets_latest_heartbeats(tmp_path):
    cfg = load_config(None, ["telemetry.metrics_port=0"])
    t = RunTelemetry.start(cfg, tmp_path, tmp_path / "metrics.jsonl")
    records, lags = [_rec("rollout-0", 10, 1, 0)], {}
    t.watch_fleet(SimpleNamespace(worker_records=lambda: records, policy_lags=lambda: dict(lags)))
    records[0] = _rec("rollout-0", 640, 9, 0)  # a heartbeat between steps
    s = _samples(t.exporter.render().decode())
    assert s["moerl_rollout_tokens_total", (("node", "10.0.0.0"), ("worker", "rollout-0"))] == 640
    assert (
        "moerl_worker_policy_lag",
        (("node", "10.0.0.0"), ("worker", "rollout-0")),
    ) not in s  # no lag known yet: no sample
    lags["rollout-0"] = 3  # the fleet's next poll counted the answer
    s = _samples(t.exporter.render().decode())
    assert s["moerl_worker_policy_lag", (("node", "10.0.0.0"), ("worker", "rollout-0"))] == 3
    t.close()


def test_endpoint_serves_during_and_closes_with_the_run(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = load_config(None, [f"telemetry.metrics_port={port}"])
    t = RunTelemetry.start(cfg, tmp_path, tmp_path / "metrics.jsonl")
    assert t.url == f"http://127.0.0.1:{port}/metrics"
    assert b"moerl_policy_version" in urllib.request.urlopen(t.url, timeout=5).read()
    t.close()
    try:
        urllib.request.urlopen(t.url, timeout=2)
        raise AssertionError("still serving after close")
    except OSError:
        pass


def test_worker_rates_are_over_the_trailing_window(tmp_path):
    t = RunTelemetry.start(load_config(None, []), tmp_path, tmp_path / "metrics.jsonl")
    rates = []
    for wall, tokens in [(0.0, 0), (4.0, 400), (11.0, 1100), (12.0, 1100), (30.0, 1100)]:
        record = t.write_step(
            1,
            wall,
            {"policy_version": 1},
            groups=[],
            workers=[_rec("rollout-0", tokens, 0, 1)],
            lags={"rollout-0": 0},
            queue=_queue(),
            buffer=_buffer(),
            step_s=0.1,
            weight_sync_s=None,
        )
        rates.append(record["rollout/workers"]["rollout-0"]["tokens_per_s"])
    # from the newest record at least 10 s old: 0 s, 0 s, 0 s, then 0 s (4 s is only 8 s old), then 12 s
    assert rates == [None, 100.0, 100.0, 1100 / 12, 0.0]
    t.close()


def _ep_rec(wid: str, intra: int, inter: int) -> WorkerRecord:
    """A worker whose EP rollout group sent ``intra`` / ``inter`` bytes in each direction so far."""
    traffic = {d: Traffic(intra_node_bytes=intra, inter_node_bytes=inter) for d in ("dispatch", "combine")}
    return WorkerRecord(wid, 0.0, WorkerState.ALIVE, health=WorkerHealth(ep_size=2, ep_traffic=traffic))


def test_ep_rollout_groups_heartbeat_bytes_are_counted_once(tmp_path):
    t = RunTelemetry.start(load_config(None, []), tmp_path, tmp_path / "metrics.jsonl")
    kw = dict(groups=[], lags={}, queue=_queue(), buffer=_buffer(), step_s=0.1, weight_sync_s=None)
    plain = _rec("rollout-9", 0, 0, 0)  # a one-rank worker: no EP bytes
    t.add_ep_traffic("dispatch", Traffic(intra_node_bytes=7))  # the trainer's step, handed in
    first = t.write_step(1, 1.0, {}, workers=[_ep_rec("rollout-0", 100, 10), plain], **kw)
    # rollout-0 grew by (50, 5) per direction; rollout-1 is new: all of its (30, 3) count
    second = t.write_step(
        2, 2.0, {}, workers=[_ep_rec("rollout-0", 150, 15), _ep_rec("rollout-1", 30, 3)], **kw
    )
    # rollout-1 restarted under the same id (counters from 0 again): its 4 bytes count, nothing is negative
    third = t.write_step(
        3, 3.0, {}, workers=[_ep_rec("rollout-0", 150, 15), _ep_rec("rollout-1", 4, 0)], **kw
    )
    assert first["ep/intra_node_bytes"] == 7 + 2 * 100 and first["ep/inter_node_bytes"] == 2 * 10
    assert (
        second["ep/intra_node_bytes"] == 207 + 2 * (50 + 30) and second["ep/inter_node_bytes"] == 20 + 2 * 8
    )
    assert third["ep/intra_node_bytes"] == 367 + 2 * 4 and third["ep/inter_node_bytes"] == 36
    s = _samples(t.exporter.render().decode())
    assert s["moerl_ep_bytes_total", (("direction", "dispatch"), ("link", "intra"))] == 7 + 100 + 50 + 30 + 4
    assert s["moerl_ep_bytes_total", (("direction", "combine"), ("link", "intra"))] == 100 + 50 + 30 + 4
    assert s["moerl_ep_bytes_total", (("direction", "combine"), ("link", "inter"))] == 10 + 5 + 3
    t.close()


def test_run_without_ep_has_null_ep_keys(tmp_path):
    t = RunTelemetry.start(load_config(None, []), tmp_path, tmp_path / "metrics.jsonl")
    kw = dict(groups=[], lags={}, queue=_queue(), buffer=_buffer(), step_s=0.1, weight_sync_s=None)
    record = t.write_step(1, 1.0, {}, workers=[_rec("rollout-0", 10, 1, 0)], **kw)
    assert record["ep/intra_node_bytes"] is None and record["ep/inter_node_bytes"] is None
    t.close()


def test_a_resumed_run_carries_the_cumulative_ep_bytes_on(tmp_path):
    t = RunTelemetry.start(load_config(None, []), tmp_path, tmp_path / "metrics.jsonl")
    kw = dict(groups=[], lags={}, queue=_queue(), buffer=_buffer(), step_s=0.1, weight_sync_s=None)
    kept = [  # metrics.jsonl up to the checkpoint's step; the newest record with EP bytes counts
        {"step": 1, "ep/intra_node_bytes": 100, "ep/inter_node_bytes": 10},
        {"step": 2, "ep/intra_node_bytes": 300, "ep/inter_node_bytes": 30},
        {"step": 3, "ep/intra_node_bytes": None, "ep/inter_node_bytes": None},
    ]
    t.carry_ep_totals(kept)
    t.add_ep_traffic("dispatch", Traffic(intra_node_bytes=7, inter_node_bytes=1))
    record = t.write_step(4, 4.0, {}, workers=[], **kw)
    assert record["ep/intra_node_bytes"] == 307 and record["ep/inter_node_bytes"] == 31
    t.close()
    fresh = RunTelemetry.start(load_config(None, []), tmp_path, tmp_path / "m2.jsonl")
    fresh.carry_ep_totals([{"step": 1, "ep/intra_node_bytes": None, "ep/inter_node_bytes": None}])
    assert fresh.write_step(2, 2.0, {}, workers=[], **kw)["ep/intra_node_bytes"] is None
    fresh.close()


def test_tokens_resumed_and_discarded_per_worker_in_the_record_and_on_metrics(tmp_path):
    cfg = load_config(None, ["telemetry.metrics_port=0"])
    t = RunTelemetry.start(cfg, tmp_path, tmp_path / "metrics.jsonl")
    alive = _rec("rollout-0", 100, 2, 1)
    alive.health = WorkerHealth(tokens_delivered=100, tokens_resumed=40, tokens_discarded=3, node="10.0.0.0")
    killed = _rec("rollout-1", 50, 1, 0, state=WorkerState.KILLED)
    killed.tokens_lost = 7  # the fleet's count: its in-flight tokens less what its snapshots kept
    record = t.write_step(
        1,
        1.0,
        {"policy_version": 1, "rollout/tokens_resumed": 40, "rollout/tokens_discarded": 10},
        groups=[],
        workers=[alive, killed],
        lags={},
        queue=_queue(),
        buffer=_buffer(),
        step_s=0.1,
        weight_sync_s=None,
    )
    w = record["rollout/workers"]
    assert (w["rollout-0"]["tokens_resumed"], w["rollout-0"]["tokens_discarded"]) == (40, 3)
    assert (w["rollout-1"]["tokens_resumed"], w["rollout-1"]["tokens_discarded"]) == (0, 7)
    assert (record["rollout/tokens_resumed"], record["rollout/tokens_discarded"]) == (40, 10)
    s = _samples(t.exporter.render().decode())
    assert s["moerl_tokens_resumed_total", (("node", "10.0.0.0"), ("worker", "rollout-0"))] == 40
    assert s["moerl_tokens_discarded_total", (("node", "10.0.0.1"), ("worker", "rollout-1"))] == 7
    t.close()
