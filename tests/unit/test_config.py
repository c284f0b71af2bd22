from pathlib import Path

import pytest

from moerl.config import ConfigError, load_config, save_config


def test_override_parses_yaml_values():
    cfg = load_config(None, ["trainer.lr=1e-5", "task.operations=['+', '*']", "runtime.mode=sync"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.task.operations == ("+", "*")
    assert cfg.runtime.mode == "sync"


def test_a_mapping_for_a_section_changes_only_its_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  max_position_embeddings: 64\n  hidden_size: 16\n")
    cfg = load_config(path, ["model={hidden_size: 32}"])
    assert (cfg.model.hidden_size, cfg.model.max_position_embeddings) == (32, 64)  # 64 kept from the file
    with pytest.raises(ConfigError, match="names no field"):
        load_config(None, ["=3"])


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'trainer.lr'"):
        load_config(None, ["trainer.lrr=1e-5"])


def test_out_of_range_names_field_value_and_range():
    with pytest.raises(ConfigError, match=r"trainer.lr=2.0 is out of range; allowed: \(0.0, 1.0\]"):
        load_config(None, ["trainer.lr=2"])


def test_integers_in_exponent_notation_are_integers():
    cfg = load_config(None, ["seed=1e3", "trainer.steps=1e1"])  # YAML 1.1 reads 1e3 as a string
    assert (cfg.seed, cfg.trainer.steps) == (1000, 10) and isinstance(cfg.seed, int)
    with pytest.raises(ConfigError, match="seed=1.5 has type float; expected int"):
        load_config(None, ["seed=1.5"])


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


def test_cli_user_mistakes_are_one_line_errors(tmp_path, capsys):
    from moerl.cli import main

    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  steps: [1\n")
    assert main(["train", "--config", str(broken)]) == 2
    assert "broken.yaml:3:1: not valid YAML" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path)]) == 2  # a folder
    assert "Is a directory" in capsys.readouterr().err
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main(["train", "--config", str(binary)]) == 2
    assert "binary.yaml: not a UTF-8 text file" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope does not exist" in capsys.readouterr().err


def test_group_estimators_need_groups_of_two_or_more():
    with pytest.raises(ConfigError, match=r"rollout.group_size=1: the grpo estimator"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"rollout.group_size=1: the rloo estimator"):
        load_config(None, ["rollout.group_size=1", "algorithm.estimator=rloo"])
    assert load_config(None, ["rollout.group_size=2"]).rollout.group_size == 2


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize("greedy", ["rollout.temperature=0", "rollout.top_k=1"])
def test_group_estimators_refuse_greedy_sampling(preset, greedy):
    # every sample of a group the same response: every group-relative advantage is 0, nothing trains
    with pytest.raises(
        ConfigError, match=r"decodes greedily: the 8 samples of a group are the same response"
    ):
        load_config(None, [greedy, f"algorithm.preset={preset}"])
    with pytest.raises(ConfigError, match=r"the rloo estimator's group-relative advantages are all 0"):
        load_config(None, [greedy, f"algorithm.preset={preset}", "algorithm.estimator=rloo"])


def test_greedy_sampling_is_left_to_ppo_and_episode_tasks():
    assert load_config(None, ["rollout.temperature=0", "algorithm.preset=ppo"]).rollout.temperature == 0
    assert load_config(None, ["rollout.top_k=1", "algorithm.preset=ppo"]).rollout.top_k == 1
    assert load_config(None, ["rollout.temperature=0.7", "rollout.top_k=2"]).rollout.top_k == 2
    episodes = Path(__file__).resolve().parents[2] / "configs" / "env_calculator.yaml"  # a GRPO env run
    assert load_config(episodes, ["rollout.temperature=0"]).rollout.temperature == 0


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "", "x\\y"])
def test_run_name_is_one_folder_name(name):
    with pytest.raises(ConfigError, match="must be a plain folder name"):
        load_config(None, [f"name={name!r}"])


def test_plain_run_name_is_kept():
    assert load_config(None, ["name=final-sync_2"]).name == "final-sync_2"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.num_workers=3", "fleet.max_workers=2"],
            "rollout.num_workers=3 is above fleet.max_workers=2",
        ),
        (
            ["rollout.num_workers=1", "fleet.min_workers=2"],
            "rollout.num_workers=1 is below fleet.min_workers=2",
        ),
    ],
)
def test_rollout_workers_outside_the_fleet_bounds_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    load_config(None, ["rollout.num_workers=2", "fleet.min_workers=2", "fleet.max_workers=2"])  # bounds met
