"""Fixtures of the multi-process tests."""

import pytest
from dist_harness import start_fork_server


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    """This xdist worker's fork server, started before its first distributed test with every case
    module and the trainer's rank code imported (``dist_harness._PRELOAD``): gloo worlds and the local
    trainer ranks of sync runs all fork from it, whichever test comes first."""
    start_fork_server()


@pytest.fixture(scope="session")
def killed_rank_run(tmp_path_factory):
    """One async run of two trainer rank actors whose rank 1 is SIGKILLed after step 6
    (``killed_rank_run.run_with_killed_rank``), read by test_rank_failure.py and test_async_sharded.py;
    both modules are one xdist group (``KILLED_RANK_GROUP``), so one worker starts it once."""
    from _runs import save_fresh_policy
    from killed_rank_run import run_with_killed_rank

    root = tmp_path_factory.mktemp("killed_rank")
    return run_with_killed_rank(root, save_fresh_policy(root / "policy"))
