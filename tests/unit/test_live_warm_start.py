"""LiveView.warm_start_progress: the SFT warm start's progress, plain lines or a rich bar."""

from __future__ import annotations

import io
import re

import pytest

from moerl.telemetry.live import LiveView


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_at_first_every_tenth_and_last_step():
    stream = io.StringIO()
    view = LiveView(5, stream=stream)
    for step in range(1, 26):
        view.warm_start_progress(step, 25, loss=1.0 / step)
    view.close()
    lines = stream.getvalue().splitlines()
    # every = 25 // 10 = 2: steps 1, 2, 4, ..., 24 and the last, 25
    shown = [int(line.split("sft step ")[1].split("/")[0]) for line in lines]
    assert shown == [1, *range(2, 25, 2), 25]
    assert lines[-1].endswith("sft step 25/25 loss 0.0400")
    assert lines[0].startswith("[") and "] sft step 1/25 loss 1.0000" in lines[0]


def test_short_warm_start_shows_every_step_and_disabled_view_is_silent():
    stream = io.StringIO()
    view = LiveView(5, stream=stream)
    for step in (1, 2, 3):
        view.warm_start_progress(step, 3, loss=0.5)
    assert len(stream.getvalue().splitlines()) == 3
    quiet = io.StringIO()
    LiveView(5, stream=quiet, enabled=False).warm_start_progress(1, 3, loss=0.5)
    assert quiet.getvalue() == ""


def test_step_out_of_range_is_an_error():
    view = LiveView(5, stream=io.StringIO())
    with pytest.raises(ValueError, match="step=0"):
        view.warm_start_progress(0, 3, loss=0.5)
    with pytest.raises(ValueError, match="step=4"):
        view.warm_start_progress(4, 3, loss=0.5)


def test_terminal_gets_a_live_line_with_the_elapsed_time():
    stream = _Terminal()
    view = LiveView(5, stream=stream)
    for step in range(1, 4):
        view.warm_start_progress(step, 3, loss=0.25)
    view.close()
    out = stream.getvalue()
    assert "sft step 3/3 loss 0.2500" in out
    # the elapsed-time column (no bar: 80 columns), then the warm start's progress as the live line itself
    assert re.search(r"\d:\d\d:\d\d\S* warm start: sft step 3/3", out)
    assert not re.search(r"\[\d\d:\d\d:\d\d\] sft", out)  # no plain timestamped lines on a terminal


def _final_frame(out: str) -> str:
    """What a terminal shows after the live display stopped: the text after its last line erase."""
    return out.rsplit("\x1b[2K", 1)[-1]


def test_the_live_line_names_each_phase_and_no_warm_start_line_outlives_it():
    """Issue 51: the line said "starting" through the warm start, and a stale ``sft step 600/600`` line
    stayed under the status line for the whole run. Now the one live line shows the warm start's progress,
    then each start-up phase, then the steps; a phase after the first step changes nothing."""
    stream = _Terminal()
    view = LiveView(5, stream=stream)
    view.warm_start_progress(1, 2, loss=0.5)
    assert "warm start: sft step 1/2 loss 0.5000" in _final_frame(stream.getvalue())
    view.warm_start_progress(2, 2, loss=0.25)
    view.phase("starting the trainer and the rollouts")
    assert "starting the trainer and the rollouts" in _final_frame(stream.getvalue())
    record = {"step": 1, "rollout/reward_mean": 0.5, "perf/rollout_tokens_per_s": 10.0, "buffer/depth": 0}
    view.update({**record, "policy_version": 1})
    view.phase("generating the first 32 groups")  # too late: the status line stays
    view.close()
    final = _final_frame(stream.getvalue())
    assert "step 1/5 reward 0.500" in final and "sft step" not in final and "generating" not in final
    assert len([ln for ln in final.splitlines() if ln.strip() and ln != "\x1b[?25h"]) == 1  # (cursor shown)


def test_phases_print_nothing_off_a_terminal():
    stream = io.StringIO()
    view = LiveView(5, stream=stream)
    view.phase("starting the trainer and the rollouts")
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("init_from", "sft_steps", "label"), [(None, 5, "warm-start eval"), ("/m", 0, "start eval")]
)
def test_the_start_eval_shows_until_the_first_rl_eval_and_names_a_warm_start_only_if_one_ran(
    init_from, sft_steps, label
):
    from types import SimpleNamespace

    from moerl.config import RunConfig
    from moerl.tasks.eval import EvalResult
    from moerl.train import Run

    cfg = RunConfig(init_from=init_from)
    cfg.sft.steps = sft_steps
    stream = io.StringIO()
    run = SimpleNamespace(
        cfg=cfg,
        state={},
        view=LiveView(5, stream=stream),
        dir=SimpleNamespace(path="runs/x"),
        startup={},
        _since_start=lambda: 1.5,
        _log_eval_samples=lambda result, step: None,  # eval_samples.jsonl: not this test's subject
    )
    Run._start_eval(run, EvalResult(0.286, 0.3, 16, 12.0, 0))
    run.view.update({"step": 1, "rollout/reward_mean": 0.1})
    lines = stream.getvalue().splitlines()
    assert f"] {label}: held-out exact match 0.286 (16 prompts)" in lines[0], lines
    assert "acc 0.286@0" in lines[1], lines
