"""Async mode with a sharded trainer: 2 trainer ranks as Ray actors (gloo, EP 2) next to one rollout worker.

The run (``killed_rank_run``: configs/default.yaml shortened to 12 steps of 4 groups x 8, a learnable
reward) is the one test_rank_failure.py kills a rank of after step 6: it must learn all the same."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("killed_rank_run")  # the session fixture's run: one worker, once


@pytest.mark.timeout(600)
def test_async_run_with_two_rank_actors_learns_exactly_once(killed_rank_run):
    summary = killed_rank_run.summary
    assert killed_rank_run.returncode == 0, killed_rank_run.output[-3000:]
    print(
        {
            k: summary[k]
            for k in ("start_eval_accuracy", "final_eval_accuracy", "tasks_duplicated", "tasks_lost")
        }
    )
    assert summary["status"] == "completed" and summary["mode"] == "async" and summary["steps"] == 12
    assert summary["trainer_ranks"] == 2 and len(set(summary["trainer_rank_pids"])) == 2
    assert summary["final_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.3
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
