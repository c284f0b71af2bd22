"""``moerl report RUN_DIR``: the run's curves as ``report.png`` and its summary as a table.

The figure has two rows of three panels: reward and eval accuracy, throughput (rollout and train
tokens/s) and buffer/queue depth, plotted against trainer step (top, integer ticks) and wall time in
seconds (bottom). Every axis is labelled with its units.

``report_fleet.png`` (``fleet_figure``) puts the rollout fleet on the wall-time axis: each worker's
rollout rate (tokens/s, from ``rollout/workers``), buffer depth, requeues, spot notices and worker kills
(cumulative), and, when the run had EP traffic, bytes/s per link class (``ep/*``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moerl.atomic import atomic_path
from moerl.rundir.folder import RunDir, SummaryError


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
    is_smoothed: bool = False
    """Per-step noise: each series is drawn raw (faint) under its rolling mean (``rolling_mean``)."""


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
        is_smoothed=True,
    ),
    Panel(
        "Buffer and queue depth",
        "depth (buffer: groups, queue: tasks)",
        (("buffer/depth", "buffer depth"), ("queue/depth", "queue depth")),
        is_count=True,
        is_smoothed=True,
    ),
)
X_AXES = (("step", "trainer step"), ("wall_s", "wall time (s)"))
"""Rows of the figure: (record key, x-axis label with units)."""


SMOOTH_POINTS = 30
"""A smoothed series' rolling window is ``len(points) // SMOOTH_POINTS`` points (so about that many
independent means span the run: 100 steps at the main job's 3000); below two points of window nothing is smoothed."""


def rolling_window(num_points: int) -> int:
    """Points in the rolling mean of a smoothed series of ``num_points`` points (1: drawn raw only)."""
    return max(1, num_points // SMOOTH_POINTS)


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing rolling mean: element i is the mean of ``values[max(0, i - window + 1) : i + 1]`` (the
    first ``window - 1`` elements average the points so far). Same length as ``values``.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"rolling_mean: window={window} must be >= 1")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot_series(ax, xs, ys, label: str, *, dots: bool, smoothed: bool) -> None:
    """One series on ``ax``: raw points, or (``smoothed`` and enough points) the raw points faint under
    their rolling mean in the same colour, the legend naming the window."""
    window = rolling_window(len(ys)) if smoothed else 1
    if window == 1:
        ax.plot(xs, ys, marker="o" if dots else None, markersize=3, label=label)
        return
    (raw,) = ax.plot(xs, ys, linewidth=0.6, alpha=0.25)
    ax.plot(xs, rolling_mean(list(ys), window), color=raw.get_color(), label=f"{label} (mean of {window})")


def _step_limits(records: list[dict], start_accuracy: float | None) -> tuple[float, float]:
    """X limits of the step row: every step shown, at least one unit wide (so that an integer tick
    falls inside even for a one-step run), padded by 3% of the span or half a step."""
    steps = [r["step"] for r in records]
    first, last = (0 if start_accuracy is not None else min(steps)), max(steps)
    pad = max(0.5, 0.03 * (last - first))
    return first - pad, last + pad


def report_figure(records: list[dict], *, start_accuracy: float | None = None, title: str = "moerl run"):
    """The report as a matplotlib ``Figure`` (2 x 3 axes): ``PANELS`` against ``X_AXES``.

    Every axis has a title and x/y labels with units; the step row has integer ticks only. The
    throughput and depth panels (``Panel.is_smoothed``) draw each series' rolling mean over its raw points
    (faint): per-step rates and depths are noise at any one step. The eval accuracy curve starts at ``(0, start_accuracy)`` (the warm start, before step 1) when given.
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
                    _plot_series(ax, xs, ys, label, dots=dots, smoothed=panel.is_smoothed)
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


FLEET_REPORT = "report_fleet.png"
"""File name of the fleet figure in the run folder."""


def _worker_rates(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(wall s, tokens/s) points per worker from the ``rollout/workers`` entries."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        for wid, entry in (r.get("rollout/workers") or {}).items():
            if entry.get("tokens_per_s") is not None:
                out.setdefault(wid, []).append((r["wall_s"], entry["tokens_per_s"]))
    return out


def _ep_rates(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(wall s, bytes/s) points per link class from the cumulative ``ep/*_node_bytes``."""
    out: dict[str, list[tuple[float, float]]] = {}
    for link in ("intra", "inter"):
        key = f"ep/{link}_node_bytes"
        pts = [(r["wall_s"], r[key]) for r in records if r.get(key) is not None]
        rates = [
            (t1, (b1 - b0) / (t1 - t0)) for (t0, b0), (t1, b1) in zip(pts, pts[1:], strict=False) if t1 > t0
        ]
        if rates:
            out[f"{link}-node"] = rates
    return out


def _points(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(wall s, value) of ``key`` where recorded."""
    return [(r["wall_s"], r[key]) for r in records if r.get(key) is not None]


def fleet_panels(records: list[dict]) -> list[tuple[str, str, dict, bool]]:
    """(title, y label with units, {legend: points}, is_count) of each ``fleet_figure`` panel; the EP
    panel only when the records have EP traffic."""
    panels = [
        ("Rollout rate per worker", "rollout rate (tokens/s)", _worker_rates(records), False),
        ("Buffer depth", "depth (groups)", {"buffer depth": _points(records, "buffer/depth")}, True),
        (
            "Requeues, notices, kills",
            "count (cumulative)",
            {
                "tasks requeued": _points(records, "queue/requeued"),
                "spot notices": _points(records, "fleet/spot_notices"),
                "workers killed": _points(records, "fleet/killed"),
            },
            True,
        ),
    ]
    if ep := _ep_rates(records):
        panels.append(("EP traffic per link class", "EP bytes/s (sent)", ep, False))
    return panels


def fleet_figure(records: list[dict], *, title: str = "moerl fleet"):
    """The fleet over wall time as a matplotlib ``Figure`` (``fleet_panels``: per-worker rollout rate,
    buffer depth, requeues / notices / kills, EP bytes/s per link class when present; 3 or 4 axes).
    Every axis is labelled with its units; a panel with nothing recorded says so."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = fleet_panels(records)
    fig = Figure(figsize=(5 * len(panels), 4.5), layout="constrained")
    for ax, (name, y_label, lines, is_count) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        for label, pts in sorted(lines.items()):
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=label)
        ax.set_title(f"{name} by wall time", fontsize=12)
        ax.set_xlabel("wall time (s)", fontsize=10)
        ax.set_ylabel(y_label, fontsize=10)
        if is_count:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=9)
        else:
            ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=14)
    return fig


class MetricsError(ValueError):
    """A ``metrics.jsonl`` that is not valid JSONL of step records (the message names the line)."""


def read_metrics(path: str | Path) -> list[dict]:
    """The step records of a run's ``metrics.jsonl``; ``[]`` when it is missing or empty.

    A torn last line after valid records (a crash mid-write) is ignored, as ``read_jsonl`` does.

    Raises:
        MetricsError: a line before the last is not JSON, the file's only line is not JSON, or a record
            is not an object with numeric ``step`` and ``wall_s``.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = [
        (n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()
    ]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1 and records:
                break  # a torn last line
            raise MetricsError(
                f"{path}: line {n} is not valid JSON ({e.msg}); not a JSONL metrics file"
            ) from None
        if not isinstance(rec, dict) or not all(
            isinstance(rec.get(k), (int, float)) and not isinstance(rec.get(k), bool)
            for k in ("step", "wall_s")
        ):
            raise MetricsError(
                f"{path}: line {n} is not a step record (an object with numeric step and wall_s)"
            )
        records.append(rec)
    return records


def plot_report(run_dir: str | Path) -> Path:
    """Draw ``report.png`` (``report_figure``) and ``report_fleet.png`` (``fleet_figure``) from
    ``metrics.jsonl``; returns the path of ``report.png``.

    Raises:
        FileNotFoundError: the folder does not exist or has no ``metrics.jsonl`` records.
        MetricsError: ``metrics.jsonl`` is not valid JSONL (``read_metrics``).
    """
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} is not a folder: nothing to plot")
    run = RunDir.existing(run_dir)  # writes nothing but the two figures
    records = read_metrics(run.metrics)
    if not records:
        raise FileNotFoundError(f"{run.metrics} has no records: nothing to plot")
    try:
        start_accuracy = (run.read_summary() or {}).get("start_eval_accuracy")
    except SummaryError:  # the curves do not need it (report_main names the damage)
        start_accuracy = None
    fig = report_figure(records, start_accuracy=start_accuracy, title=f"moerl run {run.path.name}")
    _save(fig, run.report)
    _save(fleet_figure(records, title=f"moerl fleet {run.path.name}"), run.path / FLEET_REPORT)
    return run.report


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")  # a bare Figure renders with Agg: no display needed


ALGO_KEYS = (
    "train/is_weight_mean",
    "train/is_clipfrac",
    "train/rollout_logprob_abs_diff",
    "train/rollout_kl",
    "train/kl_ref",
    "train/value_loss",
    "train/value_explained_var",
    "train/value_loss_normalized",
    "train/expert_load_cv",
    "train/expert_load_max_min",
)
"""Algorithm metrics (``moerl.trainer.algorithms``) shown for the last step when the run logged them."""


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
        for key in (
            "rollout/reward_mean",
            "perf/rollout_tokens_per_s",
            "perf/train_tokens_per_s",
            *ALGO_KEYS,
        ):
            if last.get(key) is not None:
                table.add_row(f"last step {key}", f"{last[key]:.4g}")
    return table


def _error(message: str) -> None:
    """One line on stderr (not through rich, which wraps long paths at the console width)."""
    print(f"moerl report: {message}", file=sys.stderr)


def report_main(run_dir: str | Path) -> int:
    """Regenerate ``report.png`` and print the summary table; returns a process exit code.

    Exit codes: 0 done; 2 the folder is not a run folder, has no metrics, or its ``metrics.jsonl`` is not
    valid JSONL, or its ``summary.json`` is not valid JSON (one line on stderr, like the other commands' usage
    errors). Writes nothing but the figures.
    """
    from rich.console import Console

    console = Console()
    path = Path(run_dir)
    if not path.is_dir():
        _error(f"{path} does not exist (no run folder)")
        return 2
    if not (path / "config.yaml").exists():
        _error(f"{path} is not a run folder (no config.yaml)")
        return 2
    run = RunDir.existing(path)  # creates nothing: the report's figures are all this command writes
    try:
        records = read_metrics(run.metrics)
    except MetricsError as e:
        _error(str(e))
        return 2
    if not records:
        _error(f"{run.metrics} has no records yet")
        return 2
    try:
        summary = run.read_summary() or {"status": "unfinished", "steps": records[-1]["step"]}
    except SummaryError as e:
        _error(str(e))
        return 2
    png = plot_report(run.path)
    console.print(summary_table(summary, records))
    console.print(f"figures: {png}, {png.with_name(FLEET_REPORT)}")
    return 0
