"""``moerl plan``: bad values (every numeric field outside its stated range, from --set, --file and --sweep),
plan files, flag conflicts and output paths are one-line errors before any prediction; --validate and
calibrate find the repository's bench results from any folder; what the assumptions list is what the
prediction uses."""

from __future__ import annotations

import json
from dataclasses import fields
from math import inf

import pytest

from moerl.cli import main
from moerl.plan import calibrate
from moerl.plan import cli as plan_cli
from moerl.plan.args import RESULTS
from moerl.plan.cli import assumptions
from moerl.plan.inputs import RANGES, Range, parse_param, with_params
from moerl.plan.predict import Plan, predict, set_param

CAL = json.loads(calibrate.DEFAULT_OUT.read_text())
EXAMPLE = RESULTS.parents[1] / "docs" / "plan_example.yaml"


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


def _outside(rng: Range, plan: Plan) -> list[float]:
    """Values just outside ``rng`` for ``plan``: below lo and above hi where those are finite."""
    lo, hi = rng.bounds(plan)
    out = [lo if rng.lo_open else lo - 1] if lo != -inf else []
    return out + ([hi if rng.hi_open else hi + 1] if hi != inf else [])


def test_every_numeric_field_states_a_range_that_its_default_meets():
    numeric = [f.name for f in fields(Plan) if f.type in ("int", "float")]
    assert numeric and set(numeric) == set(RANGES)
    base = Plan()
    assert all(RANGES[n].contains(getattr(base, n), base) for n in numeric)


CASES = [(name, bad) for name, rng in RANGES.items() for bad in _outside(rng, Plan())]


@pytest.mark.parametrize(("name", "bad"), CASES)
def test_out_of_range_is_refused_from_set_file_and_sweep(name, bad, tmp_path, capsys):
    value = parse_param(name, str(int(bad)) if isinstance(getattr(Plan(), name), int) else str(bad))
    needle = f"{name} must be "
    err = _one_line_error(["--set", f"{name}={value}"], capsys)
    assert needle in err and err.endswith(f"got {value}"), err
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(f"{name}: {value}\n")
    assert needle in _one_line_error(["--file", str(plan_file)], capsys)
    err = _one_line_error(["--sweep", f"{name}={getattr(Plan(), name)},{value}"], capsys)
    assert f"--sweep point {name}={value}: {needle}" in err, err


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("ep_overlap=2", "ep_overlap must be in [0, 1], got 2.0"),
        ("ep_overlap=-1", "ep_overlap must be in [0, 1], got -1.0"),
        ("weight_bytes=0", "weight_bytes must be > 0 bytes per element, got 0.0"),
        ("max_staleness=-1", "max_staleness must be >= 0 policy versions, got -1"),
        ("kernel_call_us=-5", "kernel_call_us must be >= 0 us, got -5.0"),
        ("flat_message_factor=0", "flat_message_factor must be > 0, got 0.0"),
        ("response_cv=-1", "response_cv must be >= 0, got -1.0"),
        ("steps_to_converge=0", "steps_to_converge must be >= 1 steps, got 0"),
        ("total_nodes=1", "total_nodes must be >= 2"),
        ("train_nodes=48", "train_nodes must be in [1, total_nodes=48), got 48"),
        ("topk_groups=9", "topk_groups must be in [1, router_groups=8], got 9"),
        ("router_groups=6", "router_groups=6 must divide the 256 routed experts"),
        ("top_k=200", "top_k=200 exceeds the 128 experts of the topk_groups=4 of router_groups=8"),
    ],
)
def test_the_reported_out_of_range_values_are_named_with_their_range(setting, needle, capsys):
    assert needle in _one_line_error(["--set", setting], capsys)


def test_a_train_share_split_is_checked_after_it_sets_train_nodes():
    plan = with_params(Plan(), {"train_share": "0.333", "total_nodes": "13"})  # given train_nodes=16 > 13
    # the training state needs ceil(744e9 params x 12 B / (0.9 x 141 GB x 8 GPUs)) = 9 nodes: 9 + 2 replicas of 2
    assert (plan.train_nodes, plan.rollout_nodes) == (9, 4)


def test_a_parameter_swept_twice_is_refused(capsys):
    err = _one_line_error(["--sweep", "total_nodes=48", "--sweep", "total_nodes=64"], capsys)
    assert "--sweep total_nodes given twice" in err


def test_preset_and_file_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--preset", "deepseek-v3", "--file", str(EXAMPLE)])
    assert e.value.code == 2
    assert "argument --file: not allowed with argument --preset" in capsys.readouterr().err


def test_validate_reads_the_repository_results_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--validate"]) == 0
    assert "held out" in capsys.readouterr().out
    missing = tmp_path / "none"
    err = _one_line_error(["--validate", "--results", str(missing)], capsys)
    assert f"--results {missing}: not a folder" in err
    monkeypatch.setattr(plan_cli, "RESULTS", missing)  # an installed wheel: no bench/results beside it
    err = _one_line_error(["--validate"], capsys)
    assert f"no bench results at {missing}" in err and "--results FOLDER" in err
    (missing / "perfplan").mkdir(parents=True)
    err = _one_line_error(["--validate", "--results", str(missing)], capsys)
    assert f"{missing}/ep_multi_gpu.json is missing" in err and "--results" in err
    assert "read by --validate only" in _one_line_error(["--results", str(missing)], capsys)


def test_calibrate_defaults_to_the_repository_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    seen = []

    def fit(folder):
        seen.append(folder)
        raise KeyboardInterrupt  # stop before the fit and the write

    monkeypatch.setattr(calibrate, "fit", fit)
    with pytest.raises(KeyboardInterrupt):
        calibrate.main(["--out", str(tmp_path / "cal.json")])
    assert seen == [RESULTS] and RESULTS.is_dir()
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--results", str(tmp_path / "none")])
    assert e.value.code == 2 and "not a folder" in capsys.readouterr().err


def test_spot_rates_beyond_the_availability_model_are_refused(capsys):
    spot = ["--set", "spot_rollout=true"]
    err = _one_line_error([*spot, "--set", "interruptions_per_hour=10"], capsys)  # 10 x 2 x 600 / 3600 = 3.33
    assert "interruptions_per_hour=10 x rollout_ep_nodes=2 x replace_s=600 / 3600 = 3.33 must be < 1" in err
    # 2.9 x 2 x 600 / 3600 = 0.97 < 1, but each interruption also loses the sequences in flight (~149 s)
    err = _one_line_error([*spot, "--set", "interruptions_per_hour=2.9"], capsys)
    assert "Spot: availability 1 - n lambda (lost 149 s + replace_s 600 s) = -0.21 <= 0" in err
    err = _one_line_error([*spot, "--set", "interruptions_per_hour=2.9", "--set", "auto_split=true"], capsys)
    assert "no split of total_nodes=48 fits (the last tried, train_nodes=46: Spot: availability" in err
    assert main(["plan", *spot, "--set", "interruptions_per_hour=2.9", "--set", "replace_s=300"]) == 0
