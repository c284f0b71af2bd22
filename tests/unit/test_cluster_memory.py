"""``moerl cluster render`` warns of GPUs the run would overfill (moerl.cluster.memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from moerl.cli import main as cli_main
from moerl.cluster.memory import memory_warnings
from moerl.config import load_config
from moerl.instances import gpu_memory_gb
from moerl.rollout.memory_check import ep_rank_weight_bytes, policy_arch, weight_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN, MISSION = CONFIGS / "cluster_qwen3_30b_1node.yaml", CONFIGS / "cluster_mission.yaml"


IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""


def test_an_ep_rank_holds_the_shared_parameters_and_its_share_of_the_routed_experts():
    arch = policy_arch(load_config(QWEN, [IMAGE, IMAGE]), vocab_size=1)
    routed = 48 * 128 * 3 * 2048 * 768  # Qwen3-30B-A3B: layers x experts x (gate, up, down) x d x width
    full = weight_bytes(arch, torch.bfloat16)
    assert ep_rank_weight_bytes(arch, torch.bfloat16, 1) == full
    assert ep_rank_weight_bytes(arch, torch.bfloat16, 2) == full - routed * 2 + routed * 2 // 2  # bf16: 2 B
    assert gpu_memory_gb("g6e.12xlarge") == 48.0 and gpu_memory_gb("m7i.8xlarge") is None


def test_the_qwen_recipe_fits_and_the_mission_recipe_is_warned_of():
    assert memory_warnings(load_config(QWEN, [IMAGE, IMAGE])) == []
    rollout, train = memory_warnings(load_config(MISSION, [IMAGE, IMAGE]))
    assert rollout.startswith("cluster.rollout: a rollout EP rank (rollout.ep_size=8)")
    assert "p5e.48xlarge GPU's 141 GB: the rollout workers would run out of memory" in rollout
    assert train.startswith("cluster.train: the driver holds a full") and "refuses it at start" in train
    # a cache too large for an L40S beside the EP rank's weights: the rollout group only
    (line,) = memory_warnings(
        load_config(QWEN, [IMAGE, "rollout.kv_token_budget=262144", "rollout.max_slots=128"])
    )
    assert line.startswith("cluster.rollout:") and "24.0 GiB KV cache" in line


def test_render_prints_the_warnings_and_still_writes(tmp_path, capsys):
    assert (
        cli_main(["cluster", "render", "--set", IMAGE, "--config", str(MISSION), "--out", str(tmp_path)]) == 0
    )
    out = capsys.readouterr()
    assert out.err.count("warning: cluster.") == 2 and (tmp_path / "k8s" / "30-rayjob.yaml").exists()
