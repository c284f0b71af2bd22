"""The suite's own dispatch (``tests/conftest.py``): under pytest-xdist the long work units reach the
workers first (multinode, meta, e2e, distributed, then unit; within a folder the modules with the
longest declared time limit, then grouped modules), in that order and not re-sorted by test count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def root_conftest(request):
    """The module of ``tests/conftest.py`` as pytest loaded it."""
    (module,) = [
        p
        for p in request.config.pluginmanager.get_plugins()
        if getattr(p, "__file__", "") == str(TESTS / "conftest.py")
    ]
    return module


class Item:
    """What the hook reads of a collected test: its path, markers and (no) fixtures."""

    def __init__(self, rel: str, *markers) -> None:
        self.path, self.markers, self._fixtureinfo = TESTS / rel, list(markers), None

    def add_marker(self, marker) -> None:
        self.markers.append(marker.mark if hasattr(marker, "mark") else marker)

    def get_closest_marker(self, name: str):
        return next((m for m in self.markers if m.name == name), None)


def test_long_units_are_collected_first_and_a_modules_order_is_kept(root_conftest):
    items = [
        Item("unit/test_a.py"),
        Item("unit/test_b.py", pytest.mark.xdist_group("b").mark),
        Item("distributed/test_c.py"),
        Item("e2e/test_d.py"),
        Item("e2e/test_e.py", pytest.mark.timeout(600).mark),
        Item("e2e/test_e.py"),  # the module's second test: after its first, whatever its own limit
        Item("meta/test_f.py"),
        Item("multinode/test_g.py"),
    ]
    names = {id(item): f"{item.path.parent.name}/{item.path.stem}:{n}" for n, item in enumerate(items)}
    root_conftest.pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [names[id(i)] for i in items] == [
        "multinode/test_g:7",
        "meta/test_f:6",
        "e2e/test_e:4",
        "e2e/test_e:5",
        "e2e/test_d:3",
        "distributed/test_c:2",
        "unit/test_b:1",
        "unit/test_a:0",
    ]
    assert items[0].get_closest_marker("xdist_group").args == ("netns",)


def test_xdist_keeps_the_collection_order(root_conftest):
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True))
    root_conftest.pytest_configure(config)
    assert config.option.loadscopereorder is False
