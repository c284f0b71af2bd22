"""No import cycles among moerl's modules, counting imports inside functions too.

The graph is ``_import_graph.import_graph``'s AST scan (top level and function level, not ``if
TYPE_CHECKING:``). A package's ``__init__`` importing its own submodules (re-exports) is not a cycle by
itself.
"""

from __future__ import annotations

import pytest
from _import_graph import cycles, import_graph, packages_of


def test_the_scan_sees_function_level_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")  # function-level, submodule
    (pkg / "sub" / "b.py").write_text("from .. import a\n")  # relative import of a module
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    edges = import_graph(pkg)
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.a"} and edges["pkg.c"] == set()
    assert cycles(edges, packages_of(pkg)) == [["pkg.a", "pkg.sub.b"]]


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto moerl's top-level packages and modules (``moerl.run.resume`` ->
    ``moerl.run``), without a package's imports of itself."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {top(m): set() for m in edges}
    for m, targets in edges.items():
        out[top(m)] |= {top(t) for t in targets if top(t) != top(m)}
    return out


def test_two_packages_importing_each_other_are_a_cycle():
    edges = {
        "moerl.run.resume": {"moerl.runtime.x"},
        "moerl.runtime.x": {"moerl.run.folder"},
        "moerl.run.folder": set(),
    }
    assert package_edges(edges) == {"moerl.run": {"moerl.runtime"}, "moerl.runtime": {"moerl.run"}}
    assert cycles(package_edges(edges)) == [["moerl.run", "moerl.runtime"]]


def test_moerl_packages_never_import_each_other_both_ways():
    found = cycles(package_edges(import_graph()))
    if found:
        pytest.fail(
            "packages importing each other (split the lower part out):\n"
            + "\n".join(" <-> ".join(c) for c in found)
        )


def test_moerl_has_no_import_cycles():
    found = cycles(import_graph(), packages_of())
    if found:
        pytest.fail("import cycles in moerl:\n" + "\n".join(" <-> ".join(c) for c in found))
