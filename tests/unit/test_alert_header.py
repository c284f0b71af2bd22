"""The alert rule file's header states the thresholds its rules use."""

from __future__ import annotations

import yaml

from moerl.telemetry.alerts import HEADER, AlertParams, main, render_rules


def test_default_header_is_unchanged():
    assert render_rules(AlertParams()).startswith(HEADER)


def test_header_names_the_overridden_thresholds(capsys):
    assert main(["--set", "spread=0.3", "--set", "spot_notices=5"]) == 0
    text = capsys.readouterr().out
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert "spread=0.3 (default 0.2), spot_notices=5 (default 3)" in "\n".join(head)
    assert "--set spread=0.3 --set spot_notices=5" in "\n".join(head)
    assert not text.startswith(HEADER)  # never "with its default thresholds" alone
    rules = {r["alert"]: r for r in yaml.safe_load(text)["groups"][0]["rules"]}
    assert "0.7 * max" in rules["MoerlWorkerRateSpread"]["expr"]  # the rules do use the set value
    assert ">= 5" in rules["MoerlSpotNoticeBurst"]["expr"]


def test_a_set_without_a_value_names_the_parameters(capsys):
    from moerl.telemetry.alerts import main

    assert main(["--set", "spread"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set 'spread' must look like NAME=VALUE" in err and "spread_for" in err
