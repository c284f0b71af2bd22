"""The planner's freeze: when its model (formulas and fitted constants) stopped changing, and a digest that
says whether it has changed since.

A bench point counts as held out only if it was measured after the freeze of the very model that predicts
it (``moerl.plan.holdout``). ``calibration.json`` carries the record ``freeze`` = {date, commit,
model_digest}, written by ``python -m moerl.plan.calibrate`` (a refit is a new model, so it re-freezes).

``model_digest`` is a sha256 over (a) the code of the modules whose formulas make the validated predictions
(``MODEL_MODULES``), as syntax trees with comments, docstrings and formatting dropped, so that only a change
of what the code computes changes it, and (b) the fitted values of the calibration (``FITTED_KEYS``).
A formula reshaped after the freeze therefore shows as a digest mismatch, and no point then counts as
held out until the model is frozen again (which turns every point measured before into a seen one).
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import subprocess
from pathlib import Path

MODEL_MODULES = ("calibrate.py", "hardware.py", "models.py", "timing.py", "traffic.py", "validation.py")
"""Modules of ``moerl/plan`` whose code makes the predictions ``--validate`` compares (fit, formulas,
shapes, catalog, traffic, the bench-point predictors). The protocol (``holdout.py``), presentation and the
mission-only parts (``predict.py``, ``sensitivity.py``) are not part of the frozen model."""
FITTED_KEYS = ("constants", "ep_impls", "eager_decode", "nvlink_fraction_all_to_all", "measured_code")
"""Keys of ``calibration.json`` holding fitted values and the code they measured (the rest is provenance)."""
_HERE = Path(__file__).parent


def _canon(node: object) -> str:
    """A serialization of a syntax tree that ignores positions and fields left empty (so that the fields a
    newer Python adds with empty defaults do not change it)."""
    if isinstance(node, ast.AST):
        parts = [
            f"{f}={_canon(v)}" for f in node._fields if (v := getattr(node, f, None)) is not None and v != []
        ]
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canon(x) for x in node) + "]"
    return repr(node)


def _strip_strings(tree: ast.AST) -> ast.AST:
    """Drop every statement that is a bare string (module, class, function and attribute docstrings)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [
                s for s in body
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
            ] or [ast.Pass()]  # fmt: skip
    return tree


def code_digest(source: str) -> str:
    """sha256 hex of ``source``'s syntax tree without docstrings, comments or formatting.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    return hashlib.sha256(_canon(_strip_strings(ast.parse(source))).encode()).hexdigest()


def model_digest(cal: dict, folder: Path = _HERE) -> str:
    """sha256 hex over ``MODEL_MODULES`` in ``folder`` (``code_digest`` of each) and the fitted values of
    ``cal`` (a calibration record; missing fitted keys count as absent)."""
    h = hashlib.sha256()
    for name in MODEL_MODULES:
        h.update(f"{name}:{code_digest((folder / name).read_text())}\n".encode())
    fitted = {k: cal[k] for k in FITTED_KEYS if k in cal}
    h.update(json.dumps(fitted, sort_keys=True).encode())
    return h.hexdigest()


def git_commit(folder: Path = _HERE) -> str | None:
    """``git describe --always --dirty`` of the checkout holding ``folder`` (None outside a git checkout):
    the code a fit ran on; ``-dirty`` when it had uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=folder, capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def freeze_record(cal: dict, now: datetime.datetime | None = None) -> dict:
    """{date (ISO 8601, UTC, seconds), commit (``git_commit``), model_digest} for ``cal``."""
    now = now or datetime.datetime.now(datetime.UTC)
    return {
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "model_digest": model_digest(cal),
    }


def moerl_digest(files: dict[str, bytes]) -> str:
    """sha256 hex of a moerl source tree: ``files`` maps each ``moerl/**/*.py`` path (relative, '/'
    separated) to its bytes. The identity of the code a bench point timed (``tree_files``,
    ``commit_files``)."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}:{hashlib.sha256(files[path]).hexdigest()}\n".encode())
    return h.hexdigest()


def tree_files(root: Path) -> dict[str, bytes]:
    """``moerl/**/*.py`` of the checkout (or copy) at ``root``, for ``moerl_digest``.

    Raises:
        FileNotFoundError: ``root`` has no moerl package.
    """
    pkg = Path(root) / "moerl"
    if not (pkg / "__init__.py").is_file():
        raise FileNotFoundError(2, "no moerl package here", str(pkg))
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(pkg.rglob("*.py"))}


def commit_files(commit: str, repo: Path = _HERE) -> dict[str, bytes]:
    """``moerl/**/*.py`` at ``commit`` of the git repository holding ``repo``, for ``moerl_digest``.

    Raises:
        subprocess.CalledProcessError: ``commit`` is not in the repository (or git fails).
    """
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, check=True).stdout  # noqa: E731
    names = git("ls-tree", "-r", "--full-tree", "--name-only", commit, "--", "moerl").decode().split()
    return {n: git("cat-file", "blob", f"{commit}:{n}") for n in names if n.endswith(".py")}


def parse_date(text: str, what: str) -> datetime.datetime:
    """An ISO 8601 date with a time zone, as the bench files and the freeze record write it.

    Raises:
        ValueError: ``text`` is not such a date (``what`` names where it came from).
    """
    try:
        d = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {text!r} is not an ISO 8601 date") from None
    if d.tzinfo is None:
        raise ValueError(f"{what}: {text!r} has no time zone")
    return d


def model_changed(cal: dict) -> str | None:
    """None when ``cal`` has a freeze record whose digest equals this code's ``model_digest(cal)``; else one
    line saying what is wrong (no record, or the model changed since the freeze)."""
    rec = cal.get("freeze")
    if not rec:
        return "the calibration has no freeze record (python -m moerl.plan.calibrate writes one)"
    now = model_digest(cal)
    if rec.get("model_digest") != now:
        return (
            f"the model changed since its freeze of {rec.get('date')} (digest {str(rec.get('model_digest'))[:12]} "
            f"frozen, {now[:12]} now): no point counts as held out until it is frozen again"
        )
    return None
