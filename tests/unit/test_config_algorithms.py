"""Algorithm combinations that cannot run are config errors at load time, before any warm start."""

import pytest

import moerl.run.warm_start as warm_start_module
import moerl.tasks.sft as sft
import moerl.train as train_module
from moerl.cli import main
from moerl.config import ConfigError, load_config

BAD = [
    (["algorithm.preset=dapo", "algorithm.kl_coef=0.01"], "DAPO"),
    (["trainer.ppo_epochs=2"], "recompute_proximal"),
    (["trainer.mini_batches=2", "algorithm.preset=gspo"], "recompute_proximal"),
    (["trainer.batch_groups=2", "trainer.mini_batches=3"], "at least one group"),
    (["trainer.bias_update_rate=0.001"], "e_score_correction_bias"),
    (["algorithm.mismatch_mode=icepop", "algorithm.mismatch_level=sequence"], "token-level"),
    (["trainer.aux_loss_level=sequence"], "aux_loss_coef"),
    (["algorithm.kl_in_reward=true"], "kl_coef"),
    (["algorithm.routing_replay=r2"], "routing_replay"),
    (["algorithm.mismatch_mode=clip"], "mismatch_mode"),
]

GOOD = [
    [
        "algorithm.preset=ppo",
        "trainer.ppo_epochs=4",
        "trainer.mini_batches=4",
        "trainer.recompute_proximal=true",
    ],
    ["trainer.ppo_epochs=2", "algorithm.mismatch_mode=none"],
    ["algorithm.kl_coef=0.01", "algorithm.kl_kind=k2", "algorithm.kl_in_reward=true"],
    ["model.family=deepseek_v3", "trainer.bias_update_rate=0.001"],
    ["trainer.aux_loss_coef=0.001", "trainer.aux_loss_level=sequence"],
    ["algorithm.mismatch_mode=icepop"],
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_combinations_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", GOOD)
def test_good_combinations_load(overrides):
    load_config(None, overrides)


def test_routing_replay_switches_the_engines_recording_on():
    assert load_config(None, ["algorithm.routing_replay=r3"]).rollout.return_routed_experts
    assert not load_config(None, []).rollout.return_routed_experts


def test_icepop_takes_its_papers_bounds():
    from moerl.rl import preset_from_config

    p = preset_from_config(load_config(None, ["algorithm.mismatch_mode=icepop"]).algorithm)
    assert (p.mismatch_cap_low, p.mismatch_cap) == (0.5, 5.0)


def test_moerl_train_refuses_before_the_warm_start(monkeypatch, tmp_path, capsys):
    def forbidden(*a, **k):
        raise AssertionError("the warm start ran")

    monkeypatch.setattr(warm_start_module, "warm_start", forbidden)
    monkeypatch.setattr(train_module, "warm_start", forbidden)
    monkeypatch.setattr(sft, "run_sft", forbidden)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--set", "algorithm.preset=dapo", "--set", "algorithm.kl_coef=0.01"])
    assert code == 2 and "DAPO" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.preset=ppo"],
        ["algorithm.kl_coef=0.01"],
        ["algorithm.routing_replay=r3"],
    ],
)
def test_critic_reference_and_replay_load_with_several_trainer_ranks(overrides):
    # built sharded by the trainer group (moerl.trainer.distributed.algo_models); equivalence with one rank:
    # tests/distributed/test_sharded_algorithms.py
    cfg = load_config(None, ["trainer.num_ranks=2", "trainer.ep_size=2", *overrides])
    assert cfg.trainer.num_ranks == 2
    load_config(None, overrides)
