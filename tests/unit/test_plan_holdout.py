"""The validation protocol of ``moerl plan --validate`` (moerl/plan/holdout.py): roles, dates, the freeze,
twins, and misses printed as misses. No point is excluded and no bound on the held-out error is asserted:
the error of a held-out point is a measured result that ``--validate`` reports; a test that failed on it
would push toward excluding or refitting the point, which the protocol rules out."""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path

import pytest

from moerl.cli import main
from moerl.plan import calibrate
from moerl.plan.freeze import code_digest, model_changed, model_digest, parse_date
from moerl.plan.holdout import FORMULA_CHOICES, MISS, assign_roles, summary
from moerl.plan.predict import Plan
from moerl.plan.sensitivity import calibrated_ranges, tornado
from moerl.plan.validate_report import validation_lines
from moerl.plan.validation import compare, holdout_rows

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
CAL = json.loads(calibrate.DEFAULT_OUT.read_text())
FROZEN = parse_date(CAL["freeze"]["date"], "freeze")


def _rows() -> list[dict]:
    return assign_roles(compare(CAL, RESULTS), CAL)


def test_the_shipped_model_is_the_frozen_one():
    """Formulas or fitted values changed after the freeze: re-freeze (python -m moerl.plan.calibrate), which
    turns every point measured so far into a seen one."""
    assert model_changed(CAL) is None
    assert CAL["freeze"]["model_digest"] == model_digest(CAL)
    assert CAL["freeze"]["commit"] and not CAL["freeze"]["commit"].endswith("-dirty")
    assert CAL["measured_code"]["commit"] == calibrate.MEASURED_CODE and CAL["measured_code"]["moerl_digest"]


def test_stored_points_roles_dates_and_twins(capsys):
    rows = _rows()
    assert all(r["role"] != "held out" for r in rows if parse_date(r["date"], r["source"]) <= FROZEN)
    assert all(r["role"] != "held out" for r in rows if r["quantity"] in FORMULA_CHOICES)
    fitted = {r["quantity"]: r for r in rows if r["role"] == "fitted"}
    assert len(fitted) == 13 and all(r["fitted"] for r in fitted.values())
    twins = [r for r in rows if "1x2" in r["quantity"]]
    assert len(twins) == 8 and all(r["role"] == "twin" for r in twins)
    for r in twins:  # the 2x1 row of the same dispatcher, width and routing predicts exactly the same
        twin = fitted[r["quantity"].replace("1x2", "2x1")]
        assert r["predicted"] == twin["predicted"]
    assert {r["quantity"]: r["role"] for r in rows if r["quantity"] in FORMULA_CHOICES} == {
        "decode tok/s, ep-bench EP=2 alltoall (eager)": "seen: formula",
        "decode tok/s, ep-bench EP=2 hierarchical (eager)": "seen: formula",
        "EP dispatch+combine ms, hierarchical 1x2 H=4096 zipf": "twin",
    }
    held = [r for r in rows if r["role"] == "held out"]
    for r in held:  # only runs recorded after this freeze, on the fit's code
        assert parse_date(r["date"], r["source"]) > FROZEN and r["freeze"] == CAL["freeze"]
        assert r["source"].startswith("plan_holdout_") and not r["dry_run"]
    misses = [r for r in rows if r["miss"]]
    print(
        "misses (reported, not excluded):",
        *(f"{r['role']}: {r['quantity']} {r['rel_err']:+.3f}" for r in misses),
    )
    assert {r["quantity"] for r in misses} >= {
        "decode tok/s, ep-bench EP=2 hierarchical (eager)",
        "EP dispatch+combine ms, hierarchical 1x2 H=4096 zipf",
    }


def _payload(date: datetime.datetime, **kw) -> dict:
    base = {"benchmark": "plan_holdout", "date": date.isoformat(timespec="seconds"), "freeze": CAL["freeze"],
            "code": {"moerl_digest": CAL["measured_code"]["moerl_digest"]}, "dry_run": False,
            "points": [{"kind": "decode", "spec": "reference", "batch": 32, "prompt_len": 128, "new_tokens": 128,
                        "tokens_per_s": 4000.0},
                       {"kind": "train_step", "spec": "reference", "batch": 12, "seq_len": 1024, "median_step_s": 0.35},
                       {"kind": "moe_layer", "spec": "reference", "tokens": 4096, "fwd_ms": 1.5, "fwd_bwd_ms": 4.0}]}  # fmt: skip
    return {**base, **kw}


def _roles(payload: dict, cal: dict = CAL) -> set[str]:
    return {r["role"] for r in assign_roles(holdout_rows(cal, payload, "plan_holdout_x.json"), cal)}


def test_a_run_counts_as_held_out_only_after_this_freeze_on_the_fits_code():
    after, before = FROZEN + datetime.timedelta(hours=1), FROZEN - datetime.timedelta(hours=1)
    assert _roles(_payload(after)) == {"held out"}
    assert _roles(_payload(before)) == {"seen"}
    assert _roles(_payload(after, freeze={**CAL["freeze"], "date": "2026-01-01T00:00:00+00:00"})) == {"seen"}
    assert _roles(_payload(after, dry_run=True)) == {"dry run"}
    assert _roles(_payload(after, code={"moerl_digest": "0" * 64})) == {"other code"}
    reshaped = copy.deepcopy(CAL)  # a formula constant moved after the freeze, the record left as it was
    reshaped["constants"]["decode_hbm_fraction"] *= 1.1
    assert model_changed(reshaped) and _roles(_payload(after), reshaped) == {"seen"}


def test_held_out_misses_are_printed_as_misses():
    rows = assign_roles(
        holdout_rows(CAL, _payload(FROZEN + datetime.timedelta(hours=1)), "plan_holdout_x.json"), CAL
    )
    assert [r["rel_err"] for r in rows if r["miss"]] == [
        r["rel_err"] for r in rows if abs(r["rel_err"]) > MISS
    ]
    missed = summary(rows)["held_out_misses"]
    assert missed  # 4000 tok/s at B = 32 is far from the model's figure
    text = "\n".join(validation_lines(rows, CAL))
    assert f"held out: {len(rows)} points, {len(missed)} misses" in text
    assert all(f"MISS: {r['quantity']}" in text for r in missed)


def test_code_digest_follows_formulas_not_comments_or_docstrings():
    src = 'def f(x):\n    """Doc."""\n    return 2 * x  # two\n'
    assert code_digest(src) == code_digest('def f(x):\n    """Other words."""\n\n    return 2*x\n')
    assert code_digest(src) != code_digest('def f(x):\n    """Doc."""\n    return 3 * x\n')


@pytest.mark.parametrize(
    "point,needle",
    [({"kind": "prefill"}, "unknown kind 'prefill'"), ({"kind": "decode", "spec": "reference"}, "missing batch"),
     ({"kind": "train_step", "spec": "nope", "batch": 1, "seq_len": 8, "median_step_s": 1.0}, "unknown spec 'nope'")],
)  # fmt: skip
def test_malformed_holdout_file_is_one_line(tmp_path, capsys, point, needle):
    for f in RESULTS.glob("*.json"):
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "perfplan").symlink_to(RESULTS / "perfplan")
    (tmp_path / "plan_holdout_bad.json").write_text(json.dumps(_payload(FROZEN, points=[point])))
    assert main(["plan", "--validate", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "plan_holdout_bad.json" in err and "\n" not in err


def test_cli_validate_prints_roles_freeze_and_misses(capsys):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert f"freeze: {CAL['freeze']['date']}" in out and "model since the freeze: unchanged" in out
    assert "twin 8" in out and "seen: formula 2" in out
    assert "misses among the points that are not held out" in out and "MISS" in out


def test_sensitivity_covers_every_calibrated_value():
    rows = {r["param"]: r for r in tornado(Plan(), CAL)}
    paths = calibrated_ranges(CAL)
    assert len(paths) == len(CAL["constants"]) + sum(len(v) for v in CAL["ep_impls"].values())
    assert all("calibrated." + ".".join(p[1:] if p[0] == "constants" else p) in rows for p, *_ in paths)
    hbm = rows["calibrated.decode_hbm_fraction"]
    assert hbm["ratio_high"] > hbm["base"] + 0.1 and hbm["ratio_low"] < hbm["base"] - 0.05
    assert all(r["ratio_high"] is not None for k, r in rows.items() if k.startswith("calibrated."))


def test_calibration_keeps_no_unread_negative_fit():
    for imp in CAL["ep_impls"].values():
        assert set(imp) == {"call_s", "proc_gb_s", "decode_call_s"} and min(imp.values()) > 0
    assert any("slopes" in n and "not used" in n for n in CAL["notes"])


def test_holdout_bench_dry_run_writes_what_validate_reads(tmp_path, capsys):
    """bench/plan_holdout_gpu.py on CPU (tiny model, toy sizes): the file carries the freeze, its date and
    the timed code's digest; --validate's reader predicts every point and marks them dry run."""
    from bench.plan_holdout_gpu import main as holdout_main

    with pytest.raises(SystemExit):  # a real point is an H200 measurement
        holdout_main(["--device", "cpu"])
    assert "--device cuda" in capsys.readouterr().err
    assert holdout_main(["--device", "cpu", "--dry-run", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("plan_holdout_*.json")
    payload = json.loads(path.read_text())
    assert payload["freeze"] == CAL["freeze"] and payload["dry_run"] and payload["role"] == "held out"
    assert parse_date(payload["date"], "run") > FROZEN
    rows = assign_roles(holdout_rows(CAL, payload, path.name), CAL)
    assert {p["kind"] for p in payload["points"]} == {"decode", "train_step", "moe_layer"}
    assert len(rows) == 4 and {r["role"] for r in rows} == {"dry run"}
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in rows)
