"""``moerl plan``: bad values, plan files and output paths are one-line errors before any prediction, and
what the assumptions list is what the prediction uses."""

from __future__ import annotations

import json

import pytest

from moerl.cli import main
from moerl.plan import calibrate
from moerl.plan.cli import assumptions
from moerl.plan.predict import Plan, predict, set_param

CAL = json.loads(calibrate.DEFAULT_OUT.read_text())


def _one_line_error(argv, capsys) -> str:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert "hier/flat" not in captured.out  # nothing was predicted or printed before the error
    return err


def test_invalid_yaml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("total_nodes: 24\ntrain_nodes: [16\nmodel: x\n")
    err = _one_line_error(["--file", str(bad)], capsys)
    assert f"{bad}: not valid YAML at line" in err


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("top_k=257", "top_k must be in [0, 256]"),
        ("top_k=-1", "top_k must be in [0, 256]"),
        ("train_share=1.5", "train_share must be in [0, 1)"),
        ("train_share=-0.1", "train_share must be in [0, 1)"),
        ("price_on_demand=-5", "price_on_demand must be >= 0"),
        ("price_on_demand=inf", "price_on_demand=inf is not a finite number"),
        ("net_fraction=nan", "net_fraction=nan is not a finite number"),
    ],
)
def test_out_of_range_values_are_refused(setting, needle, capsys):
    assert needle in _one_line_error(["--set", setting], capsys)


def test_validate_refuses_a_bogus_preset_and_flags_it_would_ignore(capsys):
    assert "unknown preset 'bogus'" in _one_line_error(["--validate", "--preset", "bogus"], capsys)
    err = _one_line_error(["--validate", "--set", "top_k=2"], capsys)
    assert "--validate" in err and "drop --set" in err


def test_output_paths_are_checked_first_and_named_as_given(tmp_path, capsys):
    err = _one_line_error(["--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path}: is a folder" in err
    missing = tmp_path / "nope" / "x.csv"
    err = _one_line_error(["--csv", str(missing)], capsys)
    assert f"--csv {missing}: the folder {missing.parent} does not exist" in err and ".tmp" not in err
    assert list(tmp_path.iterdir()) == []


def test_listed_price_is_the_priced_one():
    base = Plan()
    cheap = set_param(base, "price_on_demand", 5.0)
    lines = assumptions(cheap, CAL)
    assert "plan.price_on_demand = 5.0 $/node-hour (plan)" in lines
    assert "hardware.price_on_demand = 5.0 (plan)" in lines
    usd = [p.usd_per_hour for p in predict(cheap, CAL)]
    assert usd == [cheap.total_nodes * 5.0] * 2  # on-demand rollout: every node at the listed price
    assert predict(base, CAL)[0].usd_per_hour != usd[0]


def test_top_k_zero_is_the_models_own():
    assert predict(Plan(), CAL) == predict(set_param(Plan(), "top_k", 8), CAL)  # glm5-744b-a40b: top-8
    assert "plan.top_k = 8 (the model glm5-744b-a40b)" in assumptions(Plan(), CAL)


def test_invalid_calibration_json_is_named(tmp_path, capsys):
    bad = tmp_path / "cal.json"
    bad.write_text("{")
    assert f"--calibration {bad}: not valid JSON" in _one_line_error(["--calibration", str(bad)], capsys)
