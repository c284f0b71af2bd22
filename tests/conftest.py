"""Shared pytest fixtures."""

import os

import pytest
import torch

pytest.register_assert_rewrite("_runs")  # its shared asserts report their values as a test's own do

from _runs import save_fresh_policy  # noqa: E402

# Tests run on 2 cores: keep intra-op threads from oversubscribing when several processes run. Under
# pytest-xdist (the README's `-n 4`) four workers already share the cores: one thread each, and for the
# processes they start (runs, gloo ranks) unless those set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Ray instances the tests start prestart no idle task workers (moerl's actors get their own processes):
# on 2 cores each prestarted worker is seconds of CPU taken from the tests running beside it.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
# Ray starts its worker processes (every actor: rollout workers, trainer ranks, the exchange) at nice 15;
# next to three other busy xdist workers at nice 0 they then get a sliver of the 2 cores, and a run whose
# critical path goes through its actors took 5-10x its time alone. Same priority as the tests instead.
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def default_init(tmp_path_factory):
    """A fresh policy of ``configs/default.yaml``'s shape (8 experts) as a Hugging Face folder with the
    built-in tokenizer (``_runs.save_fresh_policy``); one a test module."""
    return save_fresh_policy(tmp_path_factory.mktemp("default") / "policy")


HEAVY_FIRST = ("multinode", "meta", "e2e", "distributed")
"""Test folders in the order their work reaches the xdist workers, before ``unit`` (``_dispatch_rank``)."""


def pytest_configure(config):
    """xdist hands out work units in collection order, not sorted by test count (its default, which
    dispatches a 3-test group of a 5-minute run after every 40-test group of quick checks): the order
    of ``pytest_collection_modifyitems`` below is what balances the four workers."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 4 --dist loadgroup``): the namespaced-cluster tests share host network
    state (address ranges, bridges), so they run one at a time on one worker; the mutation check's tests
    share one module fixture (six pytest subprocesses), which each worker would otherwise run again; so do
    the tests of any other module that uses a module-scoped fixture (``_uses_module_fixture``).

    Then the long work units go first (``_dispatch_rank``): the suite's wall time is bounded by the unit
    that starts last, so minutes-long groups start at once and the many short unit tests fill the
    workers at the end. The sort is stable: a module's tests keep their order."""
    for item in items:
        if "multinode" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif "meta" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("meta"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    limits: dict = {}  # a module's longest declared time limit (pytest-timeout's marker), in seconds
    for item in items:
        limits[item.path] = max(limits.get(item.path, 0), _timeout_s(item))
    items.sort(key=lambda item: _dispatch_rank(item, limits[item.path]))


def _timeout_s(item) -> float:
    """The test's own ``pytest.mark.timeout`` (its author's bound on its length), or 0 without one."""
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)) if marker else 0.0


def _dispatch_rank(item, module_limit_s: float) -> tuple[int, float, bool]:
    """(folder in ``HEAVY_FIRST`` order, ``unit`` last; the module's longest declared time limit, longest
    first; grouped before single tests): runs of the main job, gloo worlds and Ray clusters before the
    CPU-only unit checks; within a folder the modules whose authors gave a test minutes of limit, then
    those that share a trained fixture (seconds to minutes of setup), then tests that stand alone. Keys
    are per module, so a module's tests keep their order."""
    folder = next((i for i, name in enumerate(HEAVY_FIRST) if name in item.path.parts), len(HEAVY_FIRST))
    return folder, -module_limit_s, item.get_closest_marker("xdist_group") is None


def _uses_module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture (a trained run, a Ray instance, a reference step):
    such a module's tests are one xdist group, so one worker builds the fixture once instead of every
    worker that gets one of its tests building it again (twice to four times, each tens of seconds)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)
