"""moerl.api: keyword overrides as ``--set``, a config from a path, a dict or a RunConfig (issue 51). The
whole path (a shortened example run returning its summary) is tests/e2e/test_examples.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.api import nested_overrides, resolve_config
from moerl.config import ConfigError, RunConfig, load_config

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def test_double_underscores_are_the_dots_of_set():
    assert nested_overrides({"trainer__steps": 5, "seed": 1, "model__path": "m"}) == {
        "trainer": {"steps": 5},
        "seed": 1,
        "model": {"path": "m"},
    }
    with pytest.raises(ConfigError, match="section__field"):
        nested_overrides({"trainer__": 1})


def test_a_path_with_overrides_equals_the_command_line():
    got = resolve_config(DEFAULT, trainer__steps=7, runtime__mode="sync", name="007")
    want = load_config(DEFAULT, ["trainer.steps=7", "runtime.mode=sync", "name='007'"])
    assert got.trainer == want.trainer and got.runtime == want.runtime and got.model == want.model
    assert got.name == "007"  # a Python value, not YAML: no int
    assert str(DEFAULT.parent) in got.task.import_dirs  # a reward module beside the config imports


def test_dicts_and_run_configs_are_copied_not_changed():
    data = {"trainer": {"steps": 3}, "model": {"hidden_size": 32}}
    cfg = resolve_config(data, trainer__lr=1e-3, model={"num_layers": 1})
    assert (cfg.trainer.steps, cfg.trainer.lr) == (3, 1e-3)
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (32, 1)
    assert data == {"trainer": {"steps": 3}, "model": {"hidden_size": 32}}
    base = RunConfig()
    assert resolve_config(base, trainer__steps=9).trainer.steps == 9 and base.trainer.steps != 9
    assert resolve_config(None).trainer == RunConfig().trainer


def test_bad_input_is_one_error_before_anything_runs():
    with pytest.raises(ConfigError, match="trainer.step"):
        resolve_config(None, trainer__step=5)  # the closest valid key is named
    with pytest.raises(ConfigError):
        resolve_config(None, trainer__steps="many")
    with pytest.raises(FileNotFoundError):
        resolve_config("no/such/config.yaml")
    with pytest.raises(TypeError, match="a YAML path, a dict or a RunConfig"):
        resolve_config(42)
