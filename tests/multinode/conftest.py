"""Fixtures for the multi-node tests: namespaced clusters (``netns.Cluster``) that are always torn down.

Every test here needs root and ``ip netns``; without them it skips with the reason ``netns.skip_reason``
gives. ``make_cluster`` builds clusters for one test; the finalizer removes them even when the test fails
(``atexit`` in ``netns`` covers a crash of pytest itself, and the next run's ``clean_leftovers`` a kill -9).
"""

import pytest
from netns import Cluster, skip_reason


@pytest.fixture(scope="session")
def netns_ok():
    """Skips the test (with the reason) where namespaced clusters cannot be built."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def make_cluster(netns_ok):
    """``make_cluster(nodes, head_in_root=False) -> Cluster`` (built); all are closed after the test."""
    made: list[Cluster] = []

    def make(nodes: int, **kw) -> Cluster:
        c = Cluster(nodes, **kw)
        made.append(c)
        return c.build()

    yield make
    for c in made:
        c.close()
