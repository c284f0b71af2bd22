"""The config's choice lists are the registries' names: a name added to a registry is a valid config
value at once, with no second list to edit (docs/architecture.md, Layers: config sits above the leaves)."""

from __future__ import annotations

import argparse
import importlib

import pytest

import moerl.envs.base
import moerl.ep.parallelize
import moerl.rl.presets
import moerl.rl.surrogates
import moerl.tasks
import moerl.tasks.arithmetic
import moerl.tasks.datasets
from moerl.config import AlgorithmConfig, ConfigError, EnvConfig, RolloutConfig, TaskConfig, TrainerConfig
from moerl.generation import check_sizes


def test_a_new_dispatcher_is_a_choice_of_both_sections_and_of_generate(monkeypatch):
    with pytest.raises(ConfigError, match="rollout.ep_dispatcher='deepep'"):
        RolloutConfig(ep_dispatcher="deepep")
    with pytest.raises(ValueError, match="--ep-dispatcher='deepep'"):
        check_sizes(argparse.Namespace(ep_dispatcher="deepep"))
    monkeypatch.setitem(moerl.ep.parallelize.DISPATCHERS, "deepep", object)
    assert RolloutConfig(ep_dispatcher="deepep").ep_dispatcher == "deepep"
    assert TrainerConfig(ep_dispatcher="deepep").ep_dispatcher == "deepep"
    check_sizes(argparse.Namespace(ep_dispatcher="deepep"))


@pytest.mark.parametrize(
    ("registry", "field", "name"),
    [
        ("moerl.rl.presets:PRESETS", "preset", "mine"),
        ("moerl.rl.kl:KL_ESTIMATORS", "kl_kind", "k4"),
        ("moerl.rl.aggregate:AGGREGATION_MODES", "aggregation", "seq-sum"),
        ("moerl.rl.presets:ESTIMATORS", "estimator", "vine"),
        ("moerl.rl.presets:MISMATCH_MODES", "mismatch_mode", "clip"),
    ],
)
def test_a_new_rl_name_is_an_algorithm_choice(monkeypatch, registry, field, name):
    with pytest.raises(ConfigError, match=f"algorithm.{field}='{name}'"):
        AlgorithmConfig(**{field: name})
    path, attr = registry.split(":")
    module = importlib.import_module(
        path
    )  # not moerl.rl.aggregate: the package re-exports a function by that name
    table = getattr(module, attr)
    grown = {**table, name: table.get("grpo")} if isinstance(table, dict) else (*table, name)
    monkeypatch.setattr(module, attr, grown)
    assert getattr(AlgorithmConfig(**{field: name}), field) == name


def test_presets_check_surrogates_against_the_table_the_loss_calls(monkeypatch):
    with pytest.raises(ValueError, match="surrogate"):
        moerl.rl.presets.LossPreset(name="x", surrogate="reinforce")
    monkeypatch.setitem(moerl.rl.surrogates.SURROGATES, "reinforce", lambda *a: a)
    assert moerl.rl.presets.LossPreset(name="x", surrogate="reinforce").surrogate == "reinforce"


def test_a_new_task_layout_operation_or_environment_is_a_choice(monkeypatch):
    with pytest.raises(ConfigError, match="task.name='mine'"):
        TaskConfig(name="mine")
    with pytest.raises(ConfigError, match="env.name='mine'"):
        EnvConfig(name="mine")
    monkeypatch.setitem(moerl.tasks.TASKS, "mine", lambda cfg, env, score_fn, template: ("built", cfg.name))
    monkeypatch.setattr(moerl.tasks.datasets, "LAYOUTS", (*moerl.tasks.datasets.LAYOUTS, "alpaca"))
    monkeypatch.setattr(moerl.tasks.arithmetic, "OPERATIONS", (*moerl.tasks.arithmetic.OPERATIONS, "/"))
    monkeypatch.setitem(moerl.envs.base.BUILTIN_ENVS, "mine", "moerl.envs.guess:GuessEnv")
    task = TaskConfig(name="mine", layout="alpaca", operations=("/",))
    assert moerl.tasks.make_task(task) == ("built", "mine")
    assert EnvConfig(name="mine").import_path == "moerl.envs.guess:GuessEnv"


def test_a_new_weight_update_policy_is_a_rollout_choice(monkeypatch):
    import moerl.rollout.weight_update as wu

    with pytest.raises(ConfigError, match="rollout.on_weight_update='drain'"):
        RolloutConfig(on_weight_update="drain")
    monkeypatch.setattr(wu, "ON_WEIGHT_UPDATE", (*wu.ON_WEIGHT_UPDATE, "drain"))
    assert RolloutConfig(on_weight_update="drain").on_weight_update == "drain"


@pytest.mark.parametrize(("field", "registry"), [("combine", "COMBINES"), ("normalize", "NORMALIZATIONS")])
def test_a_new_reward_mix_name_is_a_reward_choice(monkeypatch, field, registry):
    import moerl.rl.reward_mix
    from moerl.config import RewardConfig

    with pytest.raises(ConfigError, match=f"reward.{field}='mine'"):
        RewardConfig(**{field: "mine"})
    monkeypatch.setitem(getattr(moerl.rl.reward_mix, registry), "mine", lambda *a: None)
    assert getattr(RewardConfig(**{field: "mine"}), field) == "mine"
