"""Shared pytest fixtures."""

import os

import pytest
import torch

pytest.register_assert_rewrite("_runs")  # its shared asserts report their values as a test's own do

from _runs import report_figures_skipped, save_fresh_policy, stop_shared_ray  # noqa: E402

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
    # a test stopped inside ``torch.no_grad()`` (pytest-timeout's exception) leaves gradients off in this
    # worker process: every later test there would fail on it, far from the cause
    torch.set_grad_enabled(True)


@pytest.fixture(scope="module")
def default_init(tmp_path_factory):
    """A fresh policy of ``configs/default.yaml``'s shape (8 experts) as a Hugging Face folder with the
    built-in tokenizer (``_runs.save_fresh_policy``); one a test module."""
    return save_fresh_policy(tmp_path_factory.mktemp("default") / "policy")


@pytest.fixture(scope="module")
def no_report_figures():
    """The module's in-process runs skip drawing their report figures (``_runs.report_figures_skipped``);
    yields the run folders whose report they asked for. Use it where no test reads ``report.png``:
    ``pytestmark = pytest.mark.usefixtures("no_report_figures")`` (before the module's other module-scoped
    fixtures, which may train in their set-up)."""
    with report_figures_skipped() as asked:
        yield asked


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "ray_group(name): the module's tests join xdist group `name` and share one Ray instance with the "
        "group's other modules (the `shared_ray` fixture of tests/e2e/conftest.py)",
    )


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test is set up
def pytest_runtest_setup(item):
    """A test outside the ``ray_group`` modules finds no shared Ray instance running (it may start its own);
    one inside them (it may run no Ray: a sync run) leaves it up for the group's next test."""
    if item.get_closest_marker("ray_group") is None and "shared_ray" not in getattr(item, "fixturenames", ()):
        stop_shared_ray()


def pytest_sessionfinish(session):
    stop_shared_ray()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 4 --dist loadgroup``): the namespaced-cluster tests share host network
    state (address ranges, bridges), so they run one at a time on one worker; the mutation check's tests
    share one module fixture (six pytest subprocesses), which each worker would otherwise run again; so do
    the tests of any other module that uses a module-scoped fixture (``_uses_module_fixture``); the modules
    marked ``ray_group(name)`` share group ``name`` (and one Ray instance, ``shared_ray``)."""
    for item in items:
        if "multinode" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif "meta" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("meta"))
        elif (shared := item.get_closest_marker("ray_group")) is not None:
            item.add_marker(pytest.mark.xdist_group(shared.args[0]))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def _uses_module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture (a trained run, a Ray instance, a reference step):
    such a module's tests are one xdist group, so one worker builds the fixture once instead of every
    worker that gets one of its tests building it again (twice to four times, each tens of seconds)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)
