"""``moerl report RUN_DIR``: the run's curves as ``report.png`` and its summary as a table.

The figure has two rows of three panels: reward and eval accuracy, throughput (rollout and train
tokens/s) and buffer/queue depth, plotted against trainer step (top, integer ticks) and wall time in
seconds (bottom). Every axis is labelled with its units.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moerl.atomic import atomic_path
from moerl.runtime.run_dir import RunDir, read_jsonl


@dataclass(frozen=True, slots=True)
class Panel:
    """One column of the report figure: a title, a y-axis label with units, and the metrics drawn."""

    title: str
    """Panel title; the figure appends "by trainer step" / "by wall time"."""
    y_label: str
    """Y-axis label, units in parentheses."""
    series: tuple[tuple[str, str], ...]
    """(metric key of ``METRIC_KEYS``, legend label) pairs."""
    is_count: bool = False
    """The values are counts: integer y ticks only."""


PANELS = (
    Panel(
        "Reward and held-out accuracy",
        "reward per sample (mean)\naccuracy (fraction, 0-1)",
        (("rollout/reward_mean", "reward mean"), ("eval/accuracy", "eval accuracy")),
    ),
    Panel(
        "Throughput",
        "throughput (tokens/s)",
        (("perf/rollout_tokens_per_s", "rollout"), ("perf/train_tokens_per_s", "train")),
    ),
    Panel(
        "Buffer and queue depth",
        "depth (buffer: groups, queue: tasks)",
        (("buffer/depth", "buffer depth"), ("queue/depth", "queue depth")),
        is_count=True,
    ),
)
X_AXES = (("step", "trainer step"), ("wall_s", "wall time (s)"))
"""Rows of the figure: (record key, x-axis label with units)."""


def _step_limits(records: list[dict], start_accuracy: float | None) -> tuple[float, float]:
    """X limits of the step row: every step shown, at least one unit wide (so that an integer tick
    falls inside even for a one-step run), padded by 3% of the span or half a step."""
    steps = [r["step"] for r in records]
    first, last = (0 if start_accuracy is not None else min(steps)), max(steps)
    pad = max(0.5, 0.03 * (last - first))
    return first - pad, last + pad


def report_figure(records: list[dict], *, start_accuracy: float | None = None, title: str = "moerl run"):
    """The report as a matplotlib ``Figure`` (2 x 3 axes): ``PANELS`` against ``X_AXES``.

    Every axis has a title and x/y labels with units; the step row has integer ticks only. The eval
    accuracy curve starts at ``(0, start_accuracy)`` (the warm start, before step 1) when given.
    A plain ``matplotlib.figure.Figure``: no pyplot, no backend, nothing to close.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 7.5), layout="constrained")
    axes = fig.subplots(2, 3)
    for row, (x_key, x_label) in enumerate(X_AXES):
        for col, panel in enumerate(PANELS):
            ax = axes[row][col]
            for key, label in panel.series:
                pts = [(r[x_key], r[key]) for r in records if r.get(key) is not None]
                if key == "eval/accuracy" and start_accuracy is not None:
                    pts.insert(0, (0, start_accuracy))
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    dots = key == "eval/accuracy" or len(pts) < 30  # a lone point needs a marker to show
                    ax.plot(xs, ys, marker="o" if dots else None, markersize=3, label=label)
            ax.set_title(f"{panel.title} by {x_label.split(' (')[0]}", fontsize=12)
            ax.set_xlabel(x_label, fontsize=10)
            ax.set_ylabel(panel.y_label, fontsize=10)
            if x_key == "step" and records:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no step 2.5
                ax.set_xlim(*_step_limits(records, start_accuracy))
            if panel.is_count:
                ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize=9)
    fig.suptitle(title, fontsize=14)
    return fig


def plot_report(run_dir: str | Path) -> Path:
    """Draw ``report.png`` (``report_figure``) from ``metrics.jsonl``; returns its path.

    Raises:
        FileNotFoundError: the folder does not exist or has no ``metrics.jsonl`` records.
    """
    if not Path(run_dir).is_dir():  # RunDir() would create it
        raise FileNotFoundError(f"{run_dir} is not a folder: nothing to plot")
    run = RunDir(run_dir)
    records = read_jsonl(run.metrics)
    if not records:
        raise FileNotFoundError(f"{run.metrics} has no records: nothing to plot")
    start_accuracy = (run.read_summary() or {}).get("start_eval_accuracy")
    fig = report_figure(records, start_accuracy=start_accuracy, title=f"moerl run {run.path.name}")
    with atomic_path(run.report) as tmp:
        fig.savefig(tmp, dpi=90, format="png")  # a bare Figure renders with Agg: no display needed
    return run.report


def summary_table(summary: dict, records: list[dict]):
    """A ``rich.table.Table`` with the summary's figures and the first/last step's key metrics."""
    from rich.table import Table

    table = Table(title="moerl run summary", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in sorted(summary):
        value = summary[key]
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, str(value))
    if records:
        last = records[-1]
        for key in ("rollout/reward_mean", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"):
            if last.get(key) is not None:
                table.add_row(f"last step {key}", f"{last[key]:.4g}")
    return table


def report_main(run_dir: str | Path) -> int:
    """Regenerate ``report.png`` and print the summary table; returns a process exit code.

    Exit codes: 0 done; 2 the folder is not a run folder or has no metrics (like the other commands'
    usage errors).
    """
    from rich.console import Console

    console = Console()
    path = Path(run_dir)
    if not (path / "config.yaml").exists():
        console.print(f"[red]moerl report: {path} is not a run folder (no config.yaml)[/red]")
        return 2
    run = RunDir(path)
    records = read_jsonl(run.metrics)
    if not records:
        console.print(f"[red]moerl report: {run.metrics} has no records yet[/red]")
        return 2
    png = plot_report(run.path)
    summary = run.read_summary() or {"status": "unfinished", "steps": records[-1]["step"]}
    console.print(summary_table(summary, records))
    console.print(f"figure: {png}")
    return 0
