"""chaos.slow_worker: the chosen worker sleeps to run at slow_factor of its speed; others are untouched."""

from __future__ import annotations

import pytest

from moerl.cli import build_parser
from moerl.config import ConfigError, load_config
from moerl.runtime.chaos import Slowdown


def test_only_the_named_worker_is_slowed():
    cfg = load_config(None, ["chaos.slow_worker=rollout-1", "chaos.slow_factor=0.25"]).chaos
    slept = []
    slow = Slowdown.from_config(cfg, "rollout-1")
    slow._sleep = slept.append
    slow.after_step(0.2)
    assert slept == [pytest.approx(0.6)]  # 0.2 s of work + 0.6 s asleep = a quarter of the speed
    other = Slowdown.from_config(cfg, "rollout-0")
    other._sleep = slept.append
    other.after_step(0.2)
    assert len(slept) == 1 and other.factor == 1.0


def test_slow_config_is_checked():
    with pytest.raises(ConfigError, match="slow_factor"):
        load_config(None, ["chaos.slow_factor=0"])
    with pytest.raises(ConfigError, match="slow_factor"):
        load_config(None, ["chaos.slow_factor=1.5"])
    assert load_config(None, []).chaos.slow_worker is None


def test_metrics_port_flag_is_a_config_override():
    args = build_parser().parse_args(["train", "--metrics-port", "9464", "--metrics-address", "0.0.0.0"])
    assert args.metrics_port == 9464 and args.metrics_address == "0.0.0.0"
    cfg = load_config(None, ["telemetry.metrics_port=9464", 'telemetry.metrics_address="0.0.0.0"'])
    assert cfg.telemetry.metrics_port == 9464 and cfg.telemetry.metrics_address == "0.0.0.0"
    assert load_config(None, []).telemetry.metrics_port == 0  # off by default
