"""A hung trainer rank (SIGSTOP) is detected through the collective timeout, not waited on forever."""

from __future__ import annotations

import os
import signal
import time

import pytest
import trainer_cases

from moerl.config import load_config
from moerl.trainer.distributed.batching import split_by_groups
from moerl.trainer.distributed.group import TrainerGroup
from moerl.trainer.distributed.rank import TrainerRankError


def test_a_stopped_rank_makes_the_step_fail_within_the_timeout(tmp_path):
    trainer_cases.save_policy(tmp_path / "policy")
    cfg = load_config(
        None, ["trainer.num_ranks=2", "trainer.ep_size=2", "trainer.batch_groups=4", "runtime.mode=sync"]
    )
    batches = trainer_cases.batches()
    assert len(split_by_groups(batches[0], 2)) == 2
    group = TrainerGroup(cfg, str(tmp_path / "policy"), num_ranks=2, timeout_s=5.0, reply_timeout_s=60.0)
    try:
        assert group.train_step(batches[0]).step == 1
        os.kill(group.pids[1], signal.SIGSTOP)  # hung: alive, never reaches the next collective
        start = time.monotonic()
        with pytest.raises(TrainerRankError, match="trainer rank 0"):  # rank 0's collective timed out
            group.train_step(batches[1])
        assert time.monotonic() - start < 45
    finally:
        group.close()  # SIGKILLs the stopped rank
