"""deploy/prometheus/rules.yaml: the committed file is the rendered default, ``promtool check rules``
accepts it, and ``promtool test rules`` passes on synthetic series where every alert fires when it
should and stays silent when it should not (and fails when the rule is weakened or removed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from _needs import program

from moerl.config import ConfigError
from moerl.telemetry.alerts import AlertParams, main, render_rules, rule_groups
from moerl.telemetry.prometheus import SERIES

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
TESTS = ROOT / "deploy" / "prometheus" / "rules_test.yaml"
ALERTS = [r["alert"] for r in rule_groups(AlertParams())["groups"][0]["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([program("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_committed_rules_are_the_rendered_defaults():
    assert RULES.read_text() == render_rules(AlertParams()), "regenerate: python3 -m moerl.telemetry.alerts"


def test_rules_use_only_exported_series():
    import re

    for rule in rule_groups(AlertParams())["groups"][0]["rules"]:
        names = set(re.findall(r"\bmoerl_[a-z_]+", rule["expr"]))
        assert names and names <= set(SERIES), (rule["alert"], names - set(SERIES))


def test_params_are_checked(capsys):
    with pytest.raises(ConfigError, match="spread"):
        AlertParams(spread=1.5)
    with pytest.raises(ConfigError, match="Prometheus duration"):
        AlertParams(rate_window="five minutes")
    assert main(["--set", "spot_notices=0"]) == 2
    assert "spot_notices" in capsys.readouterr().err
    assert main(["--set", "spot_notices=5", "--set", "spot_window=30m"]) == 0
    out = capsys.readouterr().out
    assert "increase(moerl_spot_notices_total[30m])) >= 5" in out


def test_every_alert_has_a_firing_and_a_silent_case():
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    fires, silent = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    assert fires == set(ALERTS) and silent == set(ALERTS)


@pytest.mark.parametrize(
    "params",
    [
        AlertParams(),
        AlertParams(rate_window="10s", baseline_window="20s", rate_drop_for="5s", spread_for="5s"),
    ],
)
def test_promtool_check_rules(tmp_path, params):
    path = tmp_path / "rules.yaml"
    path.write_text(render_rules(params))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass():
    result = _promtool("test", "rules", str(TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _run_with(tmp_path: Path, groups: dict) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(TESTS, tmp_path / "rules_test.yaml")
    return _promtool("test", "rules", str(tmp_path / "rules_test.yaml"))


@pytest.mark.parametrize("alert", ALERTS)
def test_unit_tests_fail_without_the_alert(tmp_path, alert):
    groups = rule_groups(AlertParams())
    rules = groups["groups"][0]["rules"]
    groups["groups"][0]["rules"] = [r for r in rules if r["alert"] != alert]
    result = _run_with(tmp_path, groups)
    assert result.returncode != 0 and alert in result.stdout + result.stderr


@pytest.mark.parametrize(
    "loose",
    [
        {"rate_drop": 0.05},  # the worker 10% below its baseline would fire
        {"spread": 0.05},  # the worker 10% below the fastest would fire
        {"starvation_wait_frac": 0.2},  # the trainer waiting 25% would fire
        {"spot_notices": 1},  # notices spread over 30m would fire
        {"staleness_for": "5m"},  # the 10m point of the staleness case would fire
        {"discarded_tokens_per_hour": 10_000},  # the 40k-token loss (~20k per worker-hour) would fire
    ],
)
def test_unit_tests_fail_with_looser_thresholds(tmp_path, loose):
    result = _run_with(tmp_path, rule_groups(AlertParams(**loose)))
    assert result.returncode != 0, f"{loose}: promtool tests still pass"


def test_example_server_config_is_valid():
    result = _promtool("check", "config", str(RULES.with_name("prometheus.yml")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout
