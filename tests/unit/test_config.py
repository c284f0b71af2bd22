import pytest

from moerl.config import ConfigError, load_config, save_config


def test_override_parses_yaml_values():
    cfg = load_config(None, ["trainer.lr=1e-5", "task.operations=['+', '*']", "runtime.mode=sync"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.task.operations == ("+", "*")
    assert cfg.runtime.mode == "sync"


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'trainer.lr'"):
        load_config(None, ["trainer.lrr=1e-5"])


def test_out_of_range_names_field_value_and_range():
    with pytest.raises(ConfigError, match=r"trainer.lr=2.0 is out of range; allowed: \(0.0, 1.0\]"):
        load_config(None, ["trainer.lr=2"])


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match="trainer.steps='abc'"):
        load_config(None, ["trainer.steps=abc"])


def test_yaml_roundtrip(tmp_path):
    cfg = load_config(None, ["rollout.group_size=4"])
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg


def test_unknown_section_suggests():
    with pytest.raises(ConfigError, match="did you mean 'trainer'"):
        load_config(None, ["trainerr.lr=1"])
