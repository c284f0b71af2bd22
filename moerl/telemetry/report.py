"""``moerl report RUN_DIR``: the run's curves as ``report.png`` and its summary as a table.

The figure has two rows of three panels: reward and eval accuracy, throughput (rollout and train
tokens/s) and buffer/queue depth, plotted against trainer step (top) and wall time (bottom).
"""

from __future__ import annotations

import json
from pathlib import Path

from moerl.runtime.run_dir import RunDir, read_jsonl

_PANELS = (
    ("reward / accuracy", (("rollout/reward_mean", "reward mean"), ("eval/accuracy", "eval accuracy"))),
    (
        "throughput (tokens/s)",
        (("perf/rollout_tokens_per_s", "rollout"), ("perf/train_tokens_per_s", "train")),
    ),
    ("depth (groups / tasks)", (("buffer/depth", "buffer depth"), ("queue/depth", "queue depth"))),
)


def plot_report(run_dir: str | Path) -> Path:
    """Draw ``report.png`` from ``metrics.jsonl``; returns its path.

    Raises:
        FileNotFoundError: the folder has no ``metrics.jsonl`` records.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe inside workers and CI
    import matplotlib.pyplot as plt

    run = RunDir(run_dir)
    records = read_jsonl(run.metrics)
    if not records:
        raise FileNotFoundError(f"{run.metrics} has no records: nothing to plot")
    start_accuracy = (run.read_summary() or {}).get("start_eval_accuracy")
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    for row, (x_key, x_label) in enumerate((("step", "trainer step"), ("wall_s", "wall time (s)"))):
        for col, (title, series) in enumerate(_PANELS):
            ax = axes[row][col]
            for key, label in series:
                pts = [(r[x_key], r[key]) for r in records if r.get(key) is not None]
                if key == "eval/accuracy" and start_accuracy is not None:
                    pts.insert(0, (0, start_accuracy))  # the warm start, before step 1
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, marker="o" if key == "eval/accuracy" else None, markersize=3, label=label)
            ax.set_title(title)
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"moerl run {run.path.name}")
    tmp = run.report.with_name(".report.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(run.report)
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

    Exit codes: 0 done; 1 the folder is not a run folder or has no metrics.
    """
    from rich.console import Console

    console = Console()
    path = Path(run_dir)
    if not (path / "config.yaml").exists():
        console.print(f"[red]moerl report: {path} is not a run folder (no config.yaml)[/red]")
        return 1
    run = RunDir(path)
    records = read_jsonl(run.metrics)
    if not records:
        console.print(f"[red]moerl report: {run.metrics} has no records yet[/red]")
        return 1
    png = plot_report(run.path)
    summary = run.read_summary() or {"status": "unfinished", "steps": records[-1]["step"]}
    console.print(summary_table(summary, records))
    console.print(f"figure: {png}")
    return 0
