"""``moerl report``: writes nothing but its figures, and names a metrics file that is not JSONL."""

from __future__ import annotations

import json

import pytest

from moerl.cli import main
from moerl.telemetry.report import MetricsError, read_metrics


def _run_folder(tmp_path, metrics: str | None):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\n")
    if metrics is not None:
        (run / "metrics.jsonl").write_text(metrics)
    return run


def _rec(step: int) -> str:
    return json.dumps({"step": step, "wall_s": 2.0 * step, "rollout/reward_mean": step / 10}) + "\n"


def test_report_creates_nothing_but_its_figures(tmp_path, capsys):
    run = _run_folder(tmp_path, _rec(1) + _rec(2))
    assert main(["report", str(run)]) == 0
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "report.png",
        "report_fleet.png",
    ]
    empty = _run_folder(tmp_path / "e", None)
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moerl report: {empty / 'metrics.jsonl'} has no records yet"
    assert sorted(p.name for p in empty.iterdir()) == ["config.yaml"]  # no checkpoints/ folder


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("garbage\n", "line 1 is not valid JSON"),
        (_rec(1) + "garbage\n" + _rec(3), "line 2 is not valid JSON"),
        ("[1, 2]\n", "line 1 is not a step record"),
        (_rec(1) + json.dumps({"step": 2}) + "\n", "line 2 is not a step record"),
    ],
)
def test_garbage_metrics_name_the_line(tmp_path, capsys, text, needle):
    run = _run_folder(tmp_path, text)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moerl report: {run / 'metrics.jsonl'}: {needle}") and "\n" not in err, err
    assert not (run / "report.png").exists() and not (run / "checkpoints").exists()
    with pytest.raises(MetricsError):
        read_metrics(run / "metrics.jsonl")


def test_a_torn_last_line_after_records_is_ignored(tmp_path):
    run = _run_folder(tmp_path, _rec(1) + '{"step": 2, "wal')
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"status": "completed"', "not valid JSON (Expecting ',' delimiter: line 1 column 23 (char 22))"),
        ("[1]", "expected a JSON object, got list"),
    ],
)
def test_a_garbled_summary_is_one_line(tmp_path, capsys, text, needle):
    run = _run_folder(tmp_path, _rec(1))
    (run / "summary.json").write_text(text)
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err == f"moerl report: {run / 'summary.json'}: {needle}\n"
