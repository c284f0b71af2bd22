"""Fixtures of the multi-process tests."""

import pytest
from dist_harness import start_fork_server


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    """This xdist worker's fork server, started before its first distributed test with every case
    module and the trainer's rank code imported (``dist_harness._PRELOAD``): gloo worlds and the local
    trainer ranks of sync runs all fork from it, whichever test comes first."""
    start_fork_server()
