"""An AST scan of moerl's import graph, shared by the import-cycle and layer-order tests.

Every ``import X`` and ``from X import Y`` anywhere in a module (top level, functions, methods) is an
edge, except those under ``if TYPE_CHECKING:`` (never executed). ``from X import Y`` where ``X.Y`` is a
module counts as importing ``X.Y``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moerl"


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skip


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _owner(target: str, mods: dict[str, Path]) -> str | None:
    """The moerl module ``target`` names (``a.b.func`` -> ``a.b``), or None outside moerl."""
    while target and target not in mods and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in mods else None


def packages_of(root: Path = ROOT) -> set[str]:
    """The modules that are packages (an ``__init__.py``)."""
    return {m for m, f in _modules(root).items() if f.name == "__init__.py"}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the moerl modules it imports anywhere in its body."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                owner = _owner(t, mods)
                if owner is not None and owner != module:
                    edges[module].add(owner)
    return edges


def _is_reexport_only(component: list[str], edges: dict[str, set[str]], packages: set[str]) -> bool:
    """A package and one of its modules, tied only because the package's ``__init__`` re-exports it."""
    plain = [m for m in component if m not in packages]
    if len(plain) >= 2:
        return False
    if not plain:
        return True
    (sub,) = plain
    return not any(
        sub in edges[p] and p in edges[sub] for p in component if p != sub and not sub.startswith(p + ".")
    )


def cycles(edges: dict[str, set[str]], packages: set[str] = frozenset()) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 and not _is_reexport_only(component, edges, packages):
                    found.append(sorted(component))
    return found
