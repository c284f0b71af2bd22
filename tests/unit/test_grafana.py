"""deploy/grafana/moerl.json: a valid Grafana dashboard model whose expressions name only exported series."""

from __future__ import annotations

import json
import re
from pathlib import Path

from moerl.telemetry.grafana import render_dashboard
from moerl.telemetry.prometheus import SERIES

PATH = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "moerl.json"


def _series_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (histogram samples map to their histogram)."""
    out = set()
    for name in re.findall(r"\bmoerl_[a-z_]+", expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        out.add(base if SERIES.get(base) == "histogram" else name)
    return out


def _panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_committed_dashboard_is_the_rendered_one():
    assert PATH.read_text() == render_dashboard(), "regenerate: python3 -m moerl.telemetry.grafana"


def test_dashboard_is_a_grafana_model():
    board = json.loads(PATH.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    panels = _panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat") and p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(ref_ids) == len(set(ref_ids))


def test_every_expression_uses_exported_series_only():
    board = json.loads(PATH.read_text())
    used = set()
    for p in _panels(board):
        for t in p.get("targets", []):
            names = _series_names(t["expr"])
            assert names and names <= set(SERIES), (p["title"], names - set(SERIES))
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            used |= names
    # every series is on the dashboard somewhere
    assert used == set(SERIES)
