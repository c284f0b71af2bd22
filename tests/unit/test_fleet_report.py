"""report_fleet.png: per-worker rollout rates, buffer depth, requeues/notices/kills and EP bytes on the
wall-time axis, from the metrics.jsonl records."""

from __future__ import annotations

import re

from moerl.config import RunConfig
from moerl.rundir.folder import RunDir
from moerl.telemetry.metrics import MetricsWriter, make_record
from moerl.telemetry.report import FLEET_REPORT, fleet_figure, fleet_panels, plot_report


def _records(ep: bool) -> list[dict]:
    out = []
    for step in range(1, 5):
        values = {
            "buffer/depth": step % 3,
            "queue/requeued": step // 2,
            "fleet/spot_notices": int(step >= 3),
            "fleet/killed": 0,
            "rollout/workers": {
                "rollout-0": {"tokens_per_s": 100.0 if step > 1 else None, "is_up": 1},
                "rollout-1": {"tokens_per_s": 50.0 if step > 1 else None, "is_up": 1},
            },
        }
        if ep:
            values |= {"ep/intra_node_bytes": 1000 * step, "ep/inter_node_bytes": 10 * step}
        out.append(make_record(step, 2.0 * step, values))
    return out


def test_panels_hold_the_per_worker_rates_and_counters():
    panels = {title: lines for title, _, lines, _ in fleet_panels(_records(ep=False))}
    assert list(panels) == ["Rollout rate per worker", "Buffer depth", "Requeues, notices, kills"]
    assert panels["Rollout rate per worker"] == {
        "rollout-0": [(4.0, 100.0), (6.0, 100.0), (8.0, 100.0)],
        "rollout-1": [(4.0, 50.0), (6.0, 50.0), (8.0, 50.0)],
    }
    assert panels["Requeues, notices, kills"]["spot notices"] == [(2.0, 0), (4.0, 0), (6.0, 1), (8.0, 1)]


def test_ep_panel_only_with_ep_traffic():
    panels = {title: lines for title, _, lines, _ in fleet_panels(_records(ep=True))}
    ep = panels["EP traffic per link class"]
    assert ep["intra-node"] == [(4.0, 500.0), (6.0, 500.0), (8.0, 500.0)]  # 1000 bytes per 2 s
    assert ep["inter-node"][0] == (4.0, 5.0)
    assert len(fleet_figure(_records(ep=True)).get_axes()) == 4
    assert len(fleet_figure(_records(ep=False)).get_axes()) == 3


def test_axes_are_labelled_with_units_and_the_png_is_written(tmp_path):
    for ax in fleet_figure(_records(ep=True)).get_axes():
        assert ax.get_title().endswith("by wall time") and ax.get_xlabel() == "wall time (s)"
        assert re.search(r"\(.+\)", ax.get_ylabel()), ax.get_ylabel()
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    writer = MetricsWriter(run.metrics)
    for r in _records(ep=False):
        writer.write(r["step"], r["wall_s"], {k: v for k, v in r.items() if k not in ("step", "wall_s")})
    plot_report(run.path)
    assert (run.path / FLEET_REPORT).read_bytes()[:4] == b"\x89PNG"
