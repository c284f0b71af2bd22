"""The last console line of ``moerl train`` carries the exactly-once task accounting of summary.json."""

from __future__ import annotations

from moerl.telemetry.live import done_line

SUMMARY = {
    "start_eval_accuracy": 0.125,
    "final_eval_accuracy": 0.5,
    "wall_time_s": 61.7,
    "tasks_duplicated": 3,
    "tasks_lost": 256,
}


def test_done_line_names_duplicated_and_lost_tasks():
    line = done_line(SUMMARY, "runs/default-1")
    assert line == "done: accuracy 0.125 -> 0.500, 62 s, tasks duplicated 3 lost 256; runs/default-1"


def test_done_line_of_an_unevaluated_stored_run_stays_one_line():
    line = done_line({**SUMMARY, "final_eval_accuracy": None}, "runs/x", "s3://b/runs/x")
    assert "\n" not in line
    assert line == (
        "done: accuracy 0.125 -> not evaluated, 62 s, tasks duplicated 3 lost 256; runs/x (stored at s3://b/runs/x)"
    )
