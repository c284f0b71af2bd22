"""report.png's figure: labelled axes with units, integer step ticks, readable titles."""

from __future__ import annotations

import re

import pytest

from moerl.config import RunConfig
from moerl.rundir.folder import RunDir
from moerl.telemetry.metrics import MetricsWriter, make_record
from moerl.telemetry.report import plot_report, report_figure


def _records(num_steps: int) -> list[dict]:
    return [
        make_record(
            step,
            1.5 * step,
            {
                "rollout/reward_mean": step / 10,
                "perf/rollout_tokens_per_s": 100.0 * step,
                "perf/train_tokens_per_s": 50.0,
                "buffer/depth": step % 2,
                "queue/depth": 1,
                "eval/accuracy": 0.5 if step == num_steps else None,
            },
        )
        for step in range(1, num_steps + 1)
    ]


def test_every_axis_has_title_and_labels_with_units():
    fig = report_figure(_records(3), start_accuracy=0.2, title="moerl run x")
    axes = fig.get_axes()
    assert len(axes) == 6
    for ax in axes:
        assert ax.get_title() and ax.title.get_fontsize() >= 10
        assert re.search(r"\(.+\)", ax.get_ylabel()), ax.get_ylabel()  # units in parentheses
        assert ax.get_xlabel() in ("trainer step", "wall time (s)")
    assert [ax.get_ylabel() for ax in axes[:3]] == [ax.get_ylabel() for ax in axes[3:]]
    assert "tokens/s" in axes[1].get_ylabel()
    assert axes[0].get_title() == "Reward and held-out accuracy by trainer step"
    assert axes[3].get_title() == "Reward and held-out accuracy by wall time"
    assert fig.get_suptitle() == "moerl run x"
    fig.canvas.draw()
    depth_ticks = [t for t in axes[2].get_yticks() if axes[2].get_ylim()[0] <= t <= axes[2].get_ylim()[1]]
    assert depth_ticks and all(float(t).is_integer() for t in depth_ticks)  # counts: no 0.5 groups
    # the eval accuracy curve starts at the warm start: (step 0, 0.2), then (step 3, 0.5)
    acc = next(line for line in axes[0].get_lines() if line.get_label() == "eval accuracy")
    assert list(acc.get_xdata()) == [0, 3] and list(acc.get_ydata()) == [0.2, 0.5]


def _visible_xticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


@pytest.mark.parametrize("num_steps", [1, 2, 3, 7])
@pytest.mark.parametrize("start_accuracy", [None, 0.1])
def test_step_ticks_are_integers(num_steps, start_accuracy):
    fig = report_figure(_records(num_steps), start_accuracy=start_accuracy)
    fig.canvas.draw()  # tick locations are computed at draw time
    for ax in fig.get_axes()[:3]:
        ticks = _visible_xticks(ax)
        assert ticks and all(t.is_integer() for t in ticks), ticks
        lo, hi = ax.get_xlim()
        assert lo < (1 if start_accuracy is None else 0) and hi > num_steps  # every point inside


def test_a_one_step_run_still_shows_its_points():
    fig = report_figure(_records(1))
    reward = next(line for line in fig.get_axes()[0].get_lines() if line.get_label() == "reward mean")
    assert reward.get_marker() == "o" and list(reward.get_xdata()) == [1]


def test_wall_time_ticks_keep_the_default_locator():
    # wall time 1.5 s .. 3 s: matplotlib's default ticks are fractional (what the step row would get)
    fig = report_figure(_records(2))
    fig.canvas.draw()
    assert any(not t.is_integer() for t in _visible_xticks(fig.get_axes()[3]))


def test_plot_report_writes_png_and_never_creates_a_missing_folder(tmp_path):
    run = RunDir.create(RunConfig(output_dir=str(tmp_path)))
    writer = MetricsWriter(run.metrics)
    for record in _records(2):
        writer.write(record["step"], record["wall_s"], {k: v for k, v in record.items() if "/" in k})
    assert plot_report(run.path).read_bytes()[:4] == b"\x89PNG"
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="not a folder"):
        plot_report(missing)
    assert not missing.exists()


def test_summary_table_shows_the_last_steps_algorithm_metrics():
    from rich.console import Console

    from moerl.telemetry.report import summary_table

    record = make_record(
        1, 1.0, {"train/kl_ref": 0.0123, "train/rollout_kl": 2.5e-7, "train/value_explained_var": 0.42}
    )
    console = Console(width=200, record=True)
    console.print(summary_table({"steps": 1}, [record]))
    text = console.export_text()
    assert "last step train/kl_ref" in text and "0.0123" in text and "2.5e-07" in text
    assert "last step train/value_explained_var" in text and "train/value_loss" not in text  # null: left out


def test_rolling_mean_is_the_trailing_mean_of_the_points_so_far():
    from moerl.telemetry.report import rolling_mean

    assert rolling_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert rolling_mean([4.0, 0.0, 8.0], 3) == [4.0, 2.0, 4.0]
    assert rolling_mean([3.0, 1.0], 1) == [3.0, 1.0]
    with pytest.raises(ValueError, match="window=0"):
        rolling_mean([1.0], 0)


def test_throughput_and_depth_are_drawn_as_a_rolling_mean_over_the_faint_raw_points():
    """500 steps of alternating 0 / 200 tokens/s: the raw line stays faint and complete, the labelled line
    is the rolling mean over 500 // 30 = 16 steps (100 once the window is full); reward stays raw."""
    records = _records(500)
    for r in records:
        r["perf/rollout_tokens_per_s"] = 200.0 * (r["step"] % 2)
        r["buffer/depth"] = 4 * (r["step"] % 2)
    fig = report_figure(records)
    for ax in fig.get_axes()[1:3]:  # throughput and depth, by step
        lines = ax.get_lines()
        raw = [ln for ln in lines if ln.get_label().startswith("_")]
        mean = [ln for ln in lines if "(mean of 16)" in ln.get_label()]
        assert len(raw) == len(mean) == 2  # each series: faint raw + its rolling mean, same colour
        assert all(ln.get_alpha() is not None and ln.get_alpha() < 0.5 for ln in raw)
        assert {ln.get_color() for ln in raw} == {ln.get_color() for ln in mean}
        first = mean[0].get_ydata()
        assert len(first) == 500 and set(first[15:]) == {max(first[15:])}  # flat once the window is full
    tokens = next(ln for ln in fig.get_axes()[1].get_lines() if ln.get_label() == "rollout (mean of 16)")
    assert list(tokens.get_ydata()[15:]) == [100.0] * 485
    raw_tokens = [ln for ln in fig.get_axes()[1].get_lines() if ln.get_label().startswith("_")][0]
    assert sorted(set(raw_tokens.get_ydata())) == [0.0, 200.0]  # the raw points, unchanged
    reward = [ln.get_label() for ln in fig.get_axes()[0].get_lines()]
    assert reward == ["reward mean", "eval accuracy"]  # the learning panel is not smoothed


def test_short_runs_are_drawn_raw():
    fig = report_figure(_records(40))  # window 40 // 30 = 1: nothing to smooth
    labels = [ln.get_label() for ln in fig.get_axes()[1].get_lines()]
    assert labels == ["rollout", "train"]
