"""Live progress of a run: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

LINE_WIDTH = 80
"""Columns the progress line fits in, with its ``[HH:MM:SS]`` prefix (plain) or elapsed time (TTY), for
runs of up to 9999 steps and a buffer of up to 999 groups."""


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _short(value: float | None) -> str:
    """A rate in at most 4 characters: 812, 9999, 12k, 1.2M, 123M ("-": not measured)."""
    if value is None:
        return "-"
    if value < 9999.5:
        return f"{value:.0f}"
    for scale, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        shown = value / scale
        text = f"{shown:.1f}" if shown < 9.95 else f"{shown:.0f}"
        if len(text) <= 3:
            return text + unit
    return f"{value / 1e9:.0f}G"


def status_line(record: dict, total_steps: int, *, eval_step: int | None = None) -> str:
    """One line of at most 68 columns (``LINE_WIDTH`` with its prefix): step, mean reward, held-out
    accuracy, rollout tokens/s, buffer depth, policy version, e.g.
    ``step 12/200 reward 0.512 acc 0.430@10 12k tok/s buf 3 v12``.

    ``acc`` is ``record["eval/accuracy"]``; ``eval_step``, when given, is the step that accuracy was
    measured at and is shown as ``@step`` (the live view repeats the last eval between evals). ``tok/s``
    is ``perf/rollout_tokens_per_s`` (the trainer's tokens/s are in ``metrics.jsonl`` and ``/metrics``).
    ``buf`` is ``buffer/depth``: groups waiting in the experience buffer after the trainer took its
    batch; ``v`` the trainer's policy version after the step.
    """
    acc = _fmt(record.get("eval/accuracy"), ".3f")
    if eval_step is not None and record.get("eval/accuracy") is not None:
        acc += f"@{eval_step}"
    return (
        f"step {record['step']}/{total_steps} reward {_fmt(record.get('rollout/reward_mean'), '.3f')} "
        f"acc {acc} {_short(record.get('perf/rollout_tokens_per_s'))} tok/s "
        f"buf {_fmt(record.get('buffer/depth'), '.0f')} v{_fmt(record.get('policy_version'), '.0f')}"
    )


def done_line(summary: dict, folder: str | Path, stored_at: str | None = None) -> str:
    """The run's last console line: held-out accuracy at start -> end, wall time, the exactly-once
    task accounting (``tasks_duplicated``, ``tasks_lost``: 0 and 0 in a sound run, see
    ``moerl.runtime.accounting``) and where the run is (``stored_at``: its storage URL, if any).

    ``summary`` is the run's ``summary.json`` dict; ``final_eval_accuracy`` may be None (not evaluated). With
    ``eval_metric == "mean_reward"`` (no notion of correctness) the line shows the mean held-out reward, so named.
    """
    label, key = "accuracy", "eval_accuracy"  # held-out exact match
    if summary.get("eval_metric") == "mean_reward":  # a task with no notion of correctness
        label, key = "mean held-out reward", "eval_mean_reward"
    start, final = summary[f"start_{key}"], summary[f"final_{key}"]
    return (
        f"done: {label} {'-' if start is None else format(start, '.3f')} -> "
        f"{'not evaluated' if final is None else format(final, '.3f')}, {summary['wall_time_s']:.0f} s, "
        f"tasks duplicated {summary['tasks_duplicated']} lost {summary['tasks_lost']}; {folder}"
        + (f" (stored at {stored_at})" if stored_at is not None else "")
    )


class LiveView:
    """Shows each step's record as it is written.

    On a TTY: a rich progress bar whose description is the latest status line. Otherwise: plain,
    timestamped lines on ``stream`` (so logs of batch jobs stay greppable) at step 1, every
    ``max(1, total_steps // 100)`` steps, at every step with an eval and at the last step.

    Args:
        total_steps: trainer steps of the run (progress bar length).
        stream: where to write (default ``sys.stderr``).
        enabled: ``False`` silences it (used by tests).
    """

    def __init__(
        self, total_steps: int, *, start_step: int = 0, stream: TextIO | None = None, enabled: bool = True
    ):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.last_accuracy: float | None = None
        self.last_eval_step: int | None = None
        self._progress = None
        self._task = None
        self._has_step = False  # a step's status line has replaced the start-up phase
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import Progress, TextColumn, TimeElapsedColumn

            # elapsed time and the status line (which counts the steps): no bar, so that the line,
            # buffer and version included, fits LINE_WIDTH columns
            self._progress = Progress(
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._progress.add_task("starting", total=total_steps, completed=start_step)
            self._progress.start()

    def message(self, text: str) -> None:
        """A free-form line (warm start, eval results, stop reasons)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)

    def phase(self, text: str) -> None:
        """Name what the run is doing before its first step (``text``, e.g. "starting rollout workers").

        On a TTY: the live line's text until the first ``update`` (the line is the run's one live line,
        so nothing stale stays under it); ignored once a step has been shown. Otherwise nothing: the
        plain log has a timestamped line for each milestone that matters already.
        """
        if self.enabled and self._progress is not None and not self._has_step:
            self._progress.update(self._task, description=text, refresh=True)  # rare: shown at once

    def warm_start_progress(self, step: int, num_steps: int, loss: float) -> None:
        """Show the SFT warm start's progress as ``warm start: sft step i/N loss x``.

        Meant as the ``progress`` callback of the warm start (called after each optimizer step). On a
        TTY: the live line itself (``phase``), updated every call, so that it says what the run is doing
        (not "starting") and leaves no stale line behind when RL begins. Otherwise: a plain timestamped
        line ``sft step i/N loss x`` at step 1, every ``max(1, num_steps // 10)`` steps and at the last
        step (about a dozen lines per warm start).

        Args:
            step: optimizer steps done, in [1, num_steps].
            num_steps: total SFT steps (``cfg.sft.steps``).
            loss: completion cross-entropy of the step, nats/token.

        Raises:
            ValueError: ``step`` not in [1, num_steps].
        """
        if not 1 <= step <= num_steps:
            raise ValueError(f"warm_start_progress: step={step} not in [1, num_steps={num_steps}]")
        if not self.enabled:
            return
        line = f"sft step {step}/{num_steps} loss {loss:.4f}"
        if self._progress is not None:
            self.phase(f"warm start: {line}")
        elif step == 1 or step == num_steps or step % max(1, num_steps // 10) == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {line}", file=self.stream, flush=True)

    def carry_last_eval(self, records: list[dict]) -> None:
        """Show the newest held-out accuracy among ``records`` until the next eval.

        For a resumed run: ``records`` are the ``metrics.jsonl`` records kept after the rewind to the
        checkpoint (``moerl.telemetry.metrics.make_record`` dicts); the newest one with
        ``eval/accuracy`` becomes the status line's ``acc ... @step``. No such record: nothing changes.
        """
        evals = [r for r in records if r.get("eval/accuracy") is not None]
        if evals:
            self.last_accuracy, self.last_eval_step = evals[-1]["eval/accuracy"], evals[-1]["step"]

    def update(self, record: dict) -> None:
        """Show a metrics record (see moerl.telemetry.metrics.make_record)."""
        step, has_eval = record["step"], record.get("eval/accuracy") is not None
        if has_eval:
            self.last_accuracy, self.last_eval_step = record["eval/accuracy"], step
        shown = dict(record)
        if not has_eval:
            shown["eval/accuracy"] = self.last_accuracy
        line = status_line(shown, self.total_steps, eval_step=self.last_eval_step)
        if not self.enabled:
            return
        if self._progress is not None:
            self._has_step = True
            self._progress.update(self._task, completed=step, description=line)
        elif has_eval or step in (1, self.total_steps) or step % max(1, self.total_steps // 100) == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {line}", file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the progress bar (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
