"""What ``moerl plan --validate`` prints: every point with its role (``moerl.plan.holdout``), the freeze,
the count per role, and every miss named as a miss."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from moerl.configlib import ConfigError
from moerl.plan.freeze import model_changed
from moerl.plan.holdout import MISS, ROLES, assign_roles, summary
from moerl.plan.validation import compare


def validation_rows(cal: dict, folder: Path) -> list[dict]:
    """``holdout.assign_roles`` of ``validation.compare`` over ``folder``.

    Raises:
        ConfigError: a bench file is missing, or a hold-out file or a date is malformed (one line naming
            the file and the folder).
    """
    try:
        return assign_roles(compare(cal, folder), cal)
    except FileNotFoundError as e:
        raise ConfigError(
            f"--validate: {e.filename} is missing (bench results read from {folder}; --results sets the folder)"
        ) from None
    except ValueError as e:
        raise ConfigError(f"--validate: {e} (bench results read from {folder})") from None


def validation_table(rows: list[dict]) -> Table:
    """One line per point: role, quantity, measurement date, measured, predicted, error, MISS."""
    t = Table(title="moerl plan --validate: predictions vs bench/results (roles: moerl/plan/holdout.py)")
    for c in ("role", "quantity", "measured on", "measured", "predicted", "error", f">{100 * MISS:.0f}%"):
        t.add_column(c, justify="left" if c in ("role", "quantity") else "right")
    for r in rows:
        t.add_row(r["role"], r["quantity"], r["date"][:10], f"{r['measured']:.4g}", f"{r['predicted']:.4g}",
                  f"{100 * r['rel_err']:+.1f}%", "MISS" if r["miss"] else "")  # fmt: skip
    return t


def validation_lines(rows: list[dict], cal: dict) -> list[str]:
    """The freeze, the model's state against it, the count per role, the held-out misses and every other
    miss, and why each point that is not fitted is not held out."""
    rec, s = cal.get("freeze") or {}, summary(rows)
    code = cal.get("measured_code") or {}
    fmt = lambda r: f"{r['quantity']} {100 * r['rel_err']:+.1f}%"  # noqa: E731
    held = [r for r in rows if r["role"] == "held out"]
    other = [r for r in rows if r["role"] != "held out" and r["miss"]]
    lines = [
        f"freeze: {rec.get('date')} at commit {rec.get('commit')}, model digest {str(rec.get('model_digest'))[:12]}; "
        f"the model predicts moerl code {code.get('commit')}",
        f"model since the freeze: {model_changed(cal) or 'unchanged (formulas and fitted values)'}",
        "points: " + ", ".join(f"{role} {s[role]}" for role in ROLES),
        f"held out: {len(held)} points, {len(s['held_out_misses'])} misses (|error| > {100 * MISS:.0f}%)"
        + "".join(f"\n  MISS: {fmt(r)}" for r in s["held_out_misses"])
        + ("" if held else " -- no point measured after the freeze yet (bench/plan_holdout_gpu.py)"),
        f"misses among the points that are not held out ({len(other)}, reported, not held out):",
        *[f"  {r['role']}: {fmt(r)}" for r in other],
        "why not held out:",
        *[f"  {r['role']}: {r['quantity']}: {r['why']}" for r in rows if r["role"] not in ("fitted", "held out")],
    ]  # fmt: skip
    return lines
