"""Metrics schema, run folder helpers, report figure and live view."""

import io
import json

import pytest

from moerl.config import RunConfig
from moerl.rundir.folder import LedgerEntry, RunDir, atomic_write_text, read_jsonl
from moerl.telemetry.live import LiveView, status_line
from moerl.telemetry.metrics import METRIC_KEYS, MetricsWriter, make_record, without_wall_clock
from moerl.telemetry.report import plot_report, report_main


def test_record_is_schema_complete_and_refuses_unknown_keys():
    rec = make_record(3, 1.23456, {"rollout/reward_mean": 0.5, "train/grad_norm": float("nan")})
    assert list(rec)[:2] == ["step", "wall_s"]
    assert set(rec) == {"step", "wall_s", *METRIC_KEYS}
    assert rec["rollout/reward_mean"] == 0.5
    assert rec["train/grad_norm"] is None  # NaN is not JSON
    assert rec["eval/accuracy"] is None
    with pytest.raises(KeyError, match="reward/mean"):
        make_record(1, 0.0, {"reward/mean": 1.0})
    with pytest.raises(TypeError, match="str"):
        make_record(1, 0.0, {"eval/accuracy": "high"})
    assert "wall_s" not in without_wall_clock(rec) and "timing/train_s" not in without_wall_clock(rec)


def test_run_dir_ledger_and_rewind(tmp_path):
    cfg = RunConfig(output_dir=str(tmp_path), name="t")
    run = RunDir.create(cfg)
    assert run.config.exists() and run.path.name.startswith("t-")
    writer = MetricsWriter(run.metrics)
    for step in (1, 2, 3):
        writer.write(step, step * 0.1, {"policy_version": step})
        run.append_ledger(
            [LedgerEntry(task_id=f"p{step}", step=step, policy_version=step - 1, lease_token=step)]
        )
    run.rewind(2)
    assert [r["step"] for r in read_jsonl(run.metrics)] == [1, 2]
    assert [e.task_id for e in run.read_ledger()] == ["p1", "p2"]


def test_read_jsonl_ignores_a_torn_last_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "wall')
    assert read_jsonl(p) == [{"step": 1}]
    atomic_write_text(p, "x")
    assert p.read_text() == "x" and not list(tmp_path.glob(".*tmp*"))


def test_report_writes_png_and_prints_table(tmp_path, capsys):
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    assert report_main(run.path) == 2  # no metrics yet
    writer = MetricsWriter(run.metrics)
    for step in range(1, 5):
        writer.write(
            step,
            step * 2.0,
            {
                "rollout/reward_mean": step / 10,
                "buffer/depth": 4 - step,
                "eval/accuracy": 0.5 if step == 4 else None,
            },
        )
    run.write_summary({"final_eval_accuracy": 0.5, "tasks_lost": 0})
    assert report_main(run.path) == 0
    out = capsys.readouterr().out
    assert "final_eval_accuracy" in out and "tasks_lost" in out
    png = plot_report(run.path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report_main(tmp_path / "nope") == 2


def test_live_view_plain_lines_carry_last_accuracy():
    stream = io.StringIO()
    view = LiveView(10, stream=stream)
    view.update(make_record(1, 1.0, {"rollout/reward_mean": 0.25, "eval/accuracy": 0.4}))
    view.update(make_record(2, 2.0, {"rollout/reward_mean": 0.5, "buffer/depth": 3}))
    view.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "step 2/10" in lines[1] and "reward 0.500" in lines[1] and "acc 0.400@1" in lines[1]
    assert "buf 3" in lines[1]
    assert "acc -" in status_line(make_record(1, 0.0, {}), 5)


def test_a_resumed_view_shows_the_kept_records_last_accuracy_until_the_next_eval():
    stream = io.StringIO()
    view = LiveView(10, stream=stream)
    kept = [make_record(1, 1.0, {"eval/accuracy": 0.3}), make_record(2, 2.0, {"eval/accuracy": 0.45}),
            make_record(3, 3.0, {})]  # fmt: skip
    view.carry_last_eval(kept)
    view.update(make_record(4, 4.0, {"rollout/reward_mean": 0.5}))
    view.update(make_record(5, 5.0, {"eval/accuracy": 0.6}))
    lines = stream.getvalue().splitlines()
    assert "acc 0.450@2" in lines[0] and "acc 0.600@5" in lines[1], lines
    fresh = LiveView(10, stream=io.StringIO())
    fresh.carry_last_eval([make_record(1, 1.0, {})])  # no eval kept: nothing to carry
    assert fresh.last_accuracy is None and fresh.last_eval_step is None


def test_live_view_plain_lines_every_hundredth_of_the_run_and_at_evals():
    stream = io.StringIO()
    view = LiveView(1000, stream=stream)
    for step in range(1, 1001):
        view.update(make_record(step, float(step), {"eval/accuracy": 0.5} if step == 55 else {}))
    steps = [int(line.split("step ")[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == sorted({1, 55, *range(10, 1001, 10)})


WIDEST = {
    "rollout/reward_mean": -0.123,
    "eval/accuracy": 0.43,
    "perf/rollout_tokens_per_s": 123456789.0,
    "buffer/depth": 999,
    "policy_version": 9999,
}
"""A record of the longest status line the width is promised for: 9999 steps, a buffer of 999 groups."""


def test_the_plain_progress_line_fits_80_columns_with_buffer_and_version():
    stream = io.StringIO()
    view = LiveView(9999, stream=stream)
    view.update(make_record(9999, 1.0, WIDEST))
    (line,) = stream.getvalue().splitlines()
    assert len(line) <= 80, (len(line), line)
    assert line.endswith("123M tok/s buf 999 v9999") and "reward -0.123 acc 0.430@9999" in line


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_terminal_progress_line_fits_80_columns_with_buffer_and_version(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    stream = _Terminal()
    view = LiveView(9999, stream=stream)
    view.update(make_record(9999, 1.0, WIDEST))
    view.close()
    shown = [line for line in stream.getvalue().splitlines() if "v9999" in line]
    assert shown and "buf 999 v9999" in shown[-1] and "step 9999/9999" in shown[-1], stream.getvalue()
    assert "0:00:0" in shown[-1], "the elapsed time was squeezed out: the line is wider than 80 columns"
