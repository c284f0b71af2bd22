"""The validation protocol of ``moerl plan --validate``: which measured points count as held out.

A point is **held out** only if it is a benchmark run recorded after the model was frozen, against that
freeze, on the code the model was fitted on, and was never used to choose a formula. Every row of
``validation.compare`` gets one role, the first that applies:

- ``fitted``: used by ``calibrate.fit``.
- ``twin``: its prediction equals a fitted point's by construction (the 1x2 dispatch rows: same ranks,
  routing and bytes as their fitted 2x1 twin), so it tests nothing the fit did not see.
- ``seen: formula``: used to choose or reshape a formula (``FORMULA_CHOICES``, with the commits).
- ``seen``: measured before the freeze (or against another freeze, or while the model differs from its
  freeze: ``freeze.model_changed``).
- ``other code``: measured on moerl code other than the code the fit's files measured (the model predicts
  that code: ``calibration.json`` ``measured_code``).
- ``dry run``: a CPU plumbing run of ``bench/plan_holdout_gpu.py``, not a measurement.
- ``held out``: the rest.

A held-out point further than ``MISS`` from its measurement is a miss and is reported as one; the bound
is a statement of the result, not a gate (no point is excluded, none refitted).
"""

from __future__ import annotations

from moerl.plan.freeze import model_changed, parse_date

MISS = 0.15
"""|predicted / measured - 1| above which a point is reported as a miss."""

FORMULA_CHOICES: dict[str, str] = {
    "decode tok/s, ep-bench EP=2 alltoall (eager)": "commits e00adf3 and 1e0f954 reshaped the EP = 2 "
    "eager-decode formula against this point (+34.8% -> +5.9%)",
    "decode tok/s, ep-bench EP=2 hierarchical (eager)": "commits e00adf3 and 1e0f954 reshaped the EP = 2 "
    "eager-decode formula against this point (+37.0% -> +29.0%)",
    "EP dispatch+combine ms, hierarchical 1x2 H=4096 zipf": "commit 1e0f954 tried a stage-wise copy term "
    "against this point and left it out (bench/NOTES.md item 13)",
}
"""Points used to choose a formula: quantity -> how (from the git history; the audit of issue 36)."""

ROLES = ("fitted", "twin", "seen: formula", "seen", "other code", "dry run", "held out")


def assign_roles(rows: list[dict], cal: dict) -> list[dict]:
    """``rows`` (``validation.compare``) each with ``role`` (one of ``ROLES``), ``why`` (one line) and
    ``miss`` (bool: |rel_err| > ``MISS``), in the same order.

    Raises:
        ValueError: a row's date or the freeze date is not an ISO 8601 date with a time zone.
    """
    rec = cal.get("freeze") or {}
    frozen = parse_date(rec["date"], "calibration freeze date") if rec.get("date") else None
    changed = model_changed(cal)
    fitted = [r for r in rows if r["fitted"]]
    code = cal.get("measured_code", {})
    out = []
    for r in rows:
        twin = next(
            (
                f
                for f in fitted
                if f["unit"] == r["unit"] and abs(f["predicted"] / r["predicted"] - 1) < 1e-12
            ),
            None,
        )
        date = parse_date(r["date"], f"{r['source']} date")
        if r["fitted"]:
            role, why = "fitted", "used by the fit"
        elif twin is not None:
            role, why = "twin", f"prediction equals the fitted '{twin['quantity']}' by construction"
            if r["quantity"] in FORMULA_CHOICES:
                why += "; also " + FORMULA_CHOICES[r["quantity"]]
        elif r["quantity"] in FORMULA_CHOICES:
            role, why = "seen: formula", FORMULA_CHOICES[r["quantity"]]
        elif frozen is None or date <= frozen:
            role, why = "seen", f"measured {r['date']}, before the freeze ({rec.get('date')})"
        elif r.get("freeze") != rec:
            role, why = "seen", f"taken against another freeze ({(r.get('freeze') or {}).get('date')})"
        elif changed:
            role, why = "seen", changed
        elif r.get("dry_run"):
            role, why = "dry run", "CPU plumbing run, not a measurement"
        elif r.get("code_digest") != code.get("moerl_digest"):
            role, why = "other code", f"measured on code other than the fit's ({code.get('commit')})"
        else:
            role, why = "held out", f"measured {r['date']}, after the freeze ({rec['date']})"
        out.append({**r, "role": role, "why": why, "miss": abs(r["rel_err"]) > MISS})
    return out


def summary(rows: list[dict]) -> dict:
    """{role: count} of ``assign_roles`` rows, plus ``held_out_misses``: the held-out rows that miss."""
    counts = {role: sum(r["role"] == role for r in rows) for role in ROLES}
    return {**counts, "held_out_misses": [r for r in rows if r["role"] == "held out" and r["miss"]]}
