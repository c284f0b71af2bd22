"""``rollout.ep_size``: checked against the policy's routed experts and the run mode at load."""

from __future__ import annotations

import json

import pytest

from moerl.config import ConfigError, load_config


def test_rollout_ep_size_loads_in_async_mode():
    cfg = load_config(None, ["rollout.ep_size=2", "runtime.mode=async", "model.num_experts=8"])
    assert cfg.rollout.ep_size == 2
    for policy in ("continue", "recompute", "abort"):  # every on_weight_update policy runs over a group
        assert load_config(None, ["rollout.ep_size=2", f"rollout.on_weight_update={policy}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.ep_size=3", "model.num_experts=8"],
            r"rollout.ep_size=3 does not divide the policy's 8 routed",
        ),
        (["rollout.ep_size=2", "runtime.mode=sync"], r"rollout.ep_size=2 needs runtime.mode=async"),
        (["rollout.ep_size=0"], r"rollout.ep_size=0 is out of range"),
        (["rollout.ep_size=2", "task.name=env"], r"multi-turn EP workers are not supported yet"),
    ],
)
def test_bad_rollout_ep_size_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_rollout_ep_size_is_checked_against_the_init_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 6}))
    with pytest.raises(ConfigError, match="rollout.ep_size=4 does not divide the policy's 6 routed experts"):
        load_config(None, [f"init_from={tmp_path}", "rollout.ep_size=4"])
    assert load_config(None, [f"init_from={tmp_path}", "rollout.ep_size=2"]).rollout.ep_size == 2
