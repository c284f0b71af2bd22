"""A trainer rank SIGKILLed by pid in the middle of an async run: the group restarts from the newest
checkpoint while the rollout worker keeps generating, the run completes, every task is trained once.

The run (``killed_rank_run``: 12 steps, checkpoints every 4, rank 1 killed after step 6) is shared with
test_async_sharded.py, which checks that it learns."""

from __future__ import annotations

import pytest
import ray  # noqa: F401 - the test extra installs it: missing fails, not skips
from killed_rank_run import STEPS

pytestmark = pytest.mark.xdist_group("killed_rank_run")  # the session fixture's run: one worker, once


@pytest.mark.timeout(600)
def test_killed_rank_restarts_the_group_and_the_run_completes(killed_rank_run):
    run = killed_rank_run
    print(run.output[-3000:])
    assert run.returncode == 0, run.output[-3000:]
    summary = run.summary
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["fleet"]["trainer_restarts"] == 1 and not set(run.pids_after) & set(run.pids_before)
    assert (
        "trainer group restarted from step 4" in run.output
        or "trainer group restarted from step 8" in run.output
    )
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
    assert summary["tasks_trained"] == STEPS * 4
