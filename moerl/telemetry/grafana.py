"""The Grafana dashboard over the exporter's series: ``deploy/grafana/moerl.json`` is ``render_dashboard()``
(a test checks the committed file equals it and that every expression names only series of
``moerl.telemetry.prometheus.SERIES``). Regenerate with

    python3 -m moerl.telemetry.grafana > deploy/grafana/moerl.json

Import it in Grafana (Dashboards -> New -> Import) and pick the Prometheus data source that scrapes
``moerl train --metrics-port N``; the ``instance`` variable selects runs. Rows: learning (reward,
held-out accuracy, policy loss, KL, entropy, staleness, learning rate, tokens/s, refused weight
versions), rollout (per-worker
token and group rates, the spread against the fastest worker, liveness and policy lag), buffer and
queue, trainer (step and weight-sync latency quantiles, waiting, policy version), faults (notices,
kills, requeues, lost work, comm errors), EP traffic and GPUs, the reward model (batches, scores, lost
workers).
"""

from __future__ import annotations

import json
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
RATE = "$__rate_interval"


def _ts(title: str, unit: str, *targets: tuple[str, str], description: str = "", stack: bool = False) -> dict:
    """A time-series panel: ``targets`` are (PromQL, legend) pairs."""
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _stat(title: str, expr: str, unit: str = "short", description: str = "") -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [{"refId": "A", "datasource": DS, "expr": expr, "legendFormat": "{{instance}}"}],
    }


def _quantiles(series: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({series}_bucket{{{SEL}}}[{RATE}])))", f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def _rollout_row() -> list[dict]:
    tok = f"rate(moerl_rollout_tokens_total{{{SEL}}}[{RATE}])"
    live_tok = f"({tok} and moerl_worker_up{{{SEL}}} == 1)"
    rollout = [
        _stat("Workers up", f"sum(moerl_worker_up{{{SEL}}})"),
        _stat("Rollout tokens/s", f"sum({tok})", "short"),
        _stat("Policy version", f"max(moerl_policy_version{{{SEL}}})"),
        _stat("Buffer depth", f"sum(moerl_buffer_depth_groups{{{SEL}}})"),
        _ts("Rollout tokens/s per worker", "short", (tok, "{{worker}}")),
        _ts(
            "Rate relative to the fastest worker",
            "percentunit",
            (
                f"{live_tok} / ignoring(worker, node) group_left max without(worker, node) {live_tok}",
                "{{worker}}",
            ),
            description="1 = as fast as the fastest live worker; the spread alert fires below 0.8.",
        ),
        _ts(
            "Groups/s per worker",
            "short",
            (f"rate(moerl_rollout_groups_total{{{SEL}}}[{RATE}])", "{{worker}}"),
        ),
        _ts(
            "Policy lag per worker",
            "short",
            (f"moerl_worker_policy_lag{{{SEL}}}", "{{worker}}"),
            (f"max(moerl_max_staleness{{{SEL}}})", "max_staleness"),
            description="Trainer version minus the worker's weights version (versions).",
        ),
    ]
    return rollout


def _buffer_row() -> list[dict]:
    return [
        _ts(
            "Experience buffer (groups)",
            "short",
            (f"moerl_buffer_depth_groups{{{SEL}}}", "depth {{instance}}"),
            (f"moerl_buffer_capacity_groups{{{SEL}}}", "capacity {{instance}}"),
        ),
        _ts("Task queue (tasks)", "short", (f"moerl_queue_depth_tasks{{{SEL}}}", "{{instance}}")),
        _ts(
            "Trainer waiting for batches",
            "percentunit",
            (f"rate(moerl_trainer_wait_seconds_total{{{SEL}}}[{RATE}])", "{{instance}}"),
            description="Fraction of wall time the trainer waited for the buffer; starvation alert above 0.5.",
        ),
    ]


def _trainer_row() -> list[dict]:
    return [
        _ts("Trainer step seconds", "s", *_quantiles("moerl_trainer_step_seconds")),
        _ts("Weight sync seconds", "s", *_quantiles("moerl_weight_sync_seconds")),
        _ts("Policy version", "short", (f"moerl_policy_version{{{SEL}}}", "{{instance}}")),
    ]


def _faults_row() -> list[dict]:
    return [
        _ts(
            "Spot notices, kills and requeues",
            "short",
            (f"sum by (worker) (increase(moerl_spot_notices_total{{{SEL}}}[{RATE}]))", "notices {{worker}}"),
            (f"sum(increase(moerl_worker_kills_total{{{SEL}}}[{RATE}]))", "worker kills"),
            (f"sum(increase(moerl_tasks_requeued_total{{{SEL}}}[{RATE}]))", "tasks requeued"),
        ),
        _ts(
            "Lost work",
            "short",
            (f"moerl_lost_work_tokens_total{{{SEL}}}", "tokens lost to interruptions"),
            (f"moerl_tasks_lost_total{{{SEL}}}", "tasks lost"),
            (f"moerl_tasks_duplicated_total{{{SEL}}}", "tasks duplicated"),
        ),
        _ts(
            "Tokens continued and discarded (per hour)",
            "short",
            # progress snapshots: a lost worker's in-flight tokens continued elsewhere, or thrown away
            (f"sum(rate(moerl_tokens_resumed_total{{{SEL}}}[{RATE}])) * 3600", "continued"),
            (f"sum(rate(moerl_tokens_discarded_total{{{SEL}}}[{RATE}])) * 3600", "discarded"),
            description="rollout/tokens_resumed and rollout/tokens_discarded: generated tokens carried into a "
            "continued sequence after a loss, and those regenerated from scratch (hard losses less snapshots)",
        ),
        _ts(
            "Communication errors",
            "short",
            (f"sum by (kind) (increase(moerl_comm_errors_total{{{SEL}}}[{RATE}]))", "{{kind}}"),
        ),
    ]


def _hardware_row() -> list[dict]:
    return [
        _ts(
            "EP bytes/s by link class",
            "Bps",
            (
                f"sum by (link, direction) (rate(moerl_ep_bytes_total{{{SEL}}}[{RATE}]))",
                "{{link}} {{direction}}",
            ),
            stack=True,
        ),
        _ts(
            "GPU utilization",
            "percentunit",
            (f"moerl_gpu_utilization_ratio{{{SEL}}}", "{{worker}} gpu{{gpu}}"),
        ),
        _ts(
            "GPU memory used",
            "bytes",
            (f"moerl_gpu_memory_used_bytes{{{SEL}}}", "{{worker}} gpu{{gpu}}"),
            (f"moerl_gpu_memory_total_bytes{{{SEL}}}", "{{worker}} gpu{{gpu}} total"),
        ),
    ]


def _learning_row() -> list[dict]:
    def g(name: str) -> str:
        return f"{name}{{{SEL}}}"

    return [
        _stat("Trainer step", f"max({g('moerl_trainer_step')})"),
        _stat("Held-out accuracy", f"max({g('moerl_eval_accuracy')})", "percentunit"),
        _stat("Reward mean", f"max({g('moerl_reward_mean')})"),
        _stat(
            "Weight versions refused",
            f"sum({g('moerl_weights_refused_total')})",
            description="Versions rollout workers refused (table, checksum or parameter set).",
        ),
        _ts(
            "Reward",
            "short",
            (g("moerl_reward_mean"), "mean {{instance}}"),
            (g("moerl_reward_std"), "std {{instance}}"),
        ),
        _ts("Held-out accuracy", "percentunit", (g("moerl_eval_accuracy"), "{{instance}}")),
        _ts("Policy loss", "short", (g("moerl_policy_loss"), "{{instance}}")),
        _ts(
            "KL (nats per token)",
            "short",
            (g("moerl_kl_ref"), "to reference {{instance}}"),
            (g("moerl_rollout_kl"), "engine vs trainer {{instance}}"),
        ),
        _ts(
            "Entropy and gradient norm",
            "short",
            (g("moerl_entropy"), "entropy {{instance}}"),
            (g("moerl_grad_norm"), "grad norm {{instance}}"),
        ),
        _ts(
            "Staleness (versions)",
            "short",
            (g("moerl_staleness_mean"), "mean {{instance}}"),
            (g("moerl_staleness_max"), "max {{instance}}"),
        ),
        _ts("Learning rate", "short", (g("moerl_learning_rate"), "{{instance}}")),
        _ts("Response length (tokens)", "short", (g("moerl_response_length_mean"), "{{instance}}")),
        _ts(
            "Tokens/s",
            "short",
            (g("moerl_rollout_tokens_per_second"), "rollout {{instance}}"),
            (g("moerl_train_tokens_per_second"), "train {{instance}}"),
        ),
    ]


def _reward_row() -> list[dict]:
    return [
        _ts(
            "Reward model batches",
            "short",
            (f"moerl_reward_batch_size{{{SEL}}}", "sequences per batch"),
            (f"moerl_reward_latency_seconds{{{SEL}}}", "seconds per batch"),
            description="reward.model_path: the reward workers' batches over the last step",
        ),
        _ts(
            "Reward model scores",
            "short",
            (f"moerl_reward_score_mean{{{SEL}}}", "mean"),
            (f"moerl_reward_score_std{{{SEL}}}", "std"),
        ),
        _ts(
            "Reward workers lost and batches rescored",
            "short",
            (f"moerl_reward_workers_lost_total{{{SEL}}}", "workers lost"),
            (f"moerl_reward_retries_total{{{SEL}}}", "batches rescored"),
        ),
    ]


def _rows() -> list[tuple[str, list[dict]]]:
    return [
        ("Learning", _learning_row()),
        ("Rollout", _rollout_row()),
        ("Buffer and queue", _buffer_row()),
        ("Trainer", _trainer_row()),
        ("Faults", _faults_row()),
        ("EP traffic and GPUs", _hardware_row()),
        ("Reward model", _reward_row()),
    ]


def _layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    """Rows of panels on Grafana's 24-column grid: stats 6 wide and 4 high, time series 8 (12 when
    two or four share a row) wide and 8 high."""
    panels, y, next_id = [], 0, 1
    for title, row_panels in rows:
        panels.append({"type": "row", "title": title, "id": next_id, "collapsed": False, "panels": []})
        panels[-1]["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
        next_id, y = next_id + 1, y + 1
        stats = [p for p in row_panels if p["type"] == "stat"]
        series = [p for p in row_panels if p["type"] != "stat"]
        for i, p in enumerate(stats):
            p.update(id=next_id, gridPos={"h": 4, "w": 6, "x": 6 * (i % 4), "y": y + 4 * (i // 4)})
            panels.append(p)
            next_id += 1
        y += 4 * ((len(stats) + 3) // 4)
        width = 12 if len(series) % 2 == 0 and len(series) % 3 != 0 else 8
        per_row = 24 // width
        for i, p in enumerate(series):
            p.update(
                id=next_id,
                gridPos={"h": 8, "w": width, "x": width * (i % per_row), "y": y + 8 * (i // per_row)},
            )
            panels.append(p)
            next_id += 1
        y += 8 * ((len(series) + per_row - 1) // per_row)
    return panels


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model (schemaVersion 39)."""
    return {
        "title": "moerl",
        "uid": "moerl-run",
        "description": "RL post-training of MoE LMs: learning, rollout fleet, buffer, trainer, faults, EP traffic.",
        "tags": ["moerl"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
                {
                    "name": "instance",
                    "label": "Run (instance)",
                    "type": "query",
                    "datasource": DS,
                    "query": {"query": "label_values(moerl_policy_version, instance)", "refId": "instance"},
                    "definition": "label_values(moerl_policy_version, instance)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": _layout(_rows()),
    }


def render_dashboard() -> str:
    """The dashboard file's text (indented JSON, newline-terminated)."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_dashboard())
