"""moerl's imports follow the layer order that docs/architecture.md declares.

The order is the fenced block under the ``## Layers`` heading, bottom layer first: each line one layer,
its package or module names separated by spaces (text after ``#`` is a comment). A name covers its
submodules (``pkg.__init__`` names the package ``pkg`` alone); a more specific name overrides its
package's line. Every import of a moerl module anywhere in
a module body (top level and inside functions; not under ``if TYPE_CHECKING:``, which never runs) must go
to the same layer or a lower one, and every moerl module must be covered by some line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _import_graph import import_graph

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def read_layers(text: str) -> list[list[str]]:
    """The layers of the first fenced block after a ``## Layers`` heading, bottom first.

    Raises ValueError if there is no such heading or block, or a layer line is empty.
    """
    heading = re.search(r"^## Layers\b.*$", text, re.MULTILINE)
    if heading is None:
        raise ValueError("no '## Layers' heading")
    block = re.search(r"^```[^\n]*\n(.*?)^```", text[heading.end() :], re.MULTILINE | re.DOTALL)
    if block is None:
        raise ValueError("no fenced block under '## Layers'")
    layers = [line.split("#", 1)[0].split() for line in block.group(1).splitlines()]
    return [names for names in layers if names]


def covers(name: str, module: str) -> bool:
    """Whether the layer name ``name`` covers ``module``: the module itself or one under the package
    ``name``; ``pkg.__init__`` covers the package ``pkg`` alone."""
    if name.endswith(".__init__"):
        return module == name.removesuffix(".__init__")
    return module == name or module.startswith(name + ".")


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The index of the layer whose most specific name covers ``module``, or None."""
    best: tuple[int, int] | None = None  # (name length, layer)
    for i, names in enumerate(layers):
        for name in names:
            if covers(name, module) and (best is None or len(name) > best[0]):
                best = (len(name), i)
    return None if best is None else best[1]


def layer_problems(edges: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """One line per problem: a name listed twice or naming no module, a package split over two layers (a
    submodule listed apart from its package), a module no line covers, an upward import (``a -> b
    (layer i -> layer j)``)."""
    problems = []
    listed = [name for names in layers for name in names]
    for name in sorted({n for n in listed if listed.count(n) > 1}):
        problems.append(f"{name} is listed in more than one layer")
    for name in listed:
        for package in listed:
            if name != package and covers(package, name) and not package.endswith(".__init__"):
                problems.append(
                    f"{name} splits the package {package} over layers: make it a package of its own"
                )
    for name in listed:
        if not any(covers(name, m) for m in edges):
            problems.append(f"{name} names no moerl module")
    level = {m: layer_of(m, layers) for m in edges}
    problems += [f"{m} is in no layer" for m in sorted(edges) if level[m] is None]
    for m in sorted(edges):
        for target in sorted(edges[m]):
            i, j = level[m], level[target]
            if i is not None and j is not None and j > i:
                problems.append(f"{m} -> {target} (layer {i} -> layer {j})")
    return problems


def test_the_check_finds_upward_and_unlisted_modules():
    layers = read_layers(
        "# x\n\n## Layers\n\n```\npkg.__init__ pkg.b  # base\npkg.a\n```\n\n```\nnot this\n```\n"
    )
    assert layers == [["pkg.__init__", "pkg.b"], ["pkg.a"]]
    assert (
        layer_of("pkg.b.c", layers) == 0 and layer_of("pkg.a.c", layers) == 1 and layer_of("pkg", layers) == 0
    )
    assert layer_of("pkg.c", layers) is None  # pkg.__init__ is the package alone
    edges = {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a.x"}, "pkg.a.x": set(), "pkg.c": {"pkg.a"}}
    assert layer_problems(edges, layers) == [
        "pkg.c is in no layer",
        "pkg -> pkg.a (layer 0 -> layer 1)",
        "pkg.b -> pkg.a.x (layer 0 -> layer 1)",
    ]
    assert layer_problems({"pkg": set()}, [["pkg", "gone"], ["pkg"]]) == [
        "pkg is listed in more than one layer",
        "gone names no moerl module",
    ]
    split = {"pkg.a": set(), "pkg.a.low": set()}
    assert layer_problems(split, [["pkg.a.low"], ["pkg.a"]]) == [
        "pkg.a.low splits the package pkg.a over layers: make it a package of its own"
    ]


def test_moerl_imports_follow_the_documented_layers():
    layers = read_layers(DOC.read_text())
    problems = layer_problems(import_graph(), layers)
    if problems:
        pytest.fail(
            f"imports against the layer order of {DOC.name} (## Layers, bottom first):\n"
            + "\n".join(problems)
        )
