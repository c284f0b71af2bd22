"""``moerl cluster render`` warns of GPUs the run would overfill (moerl.cluster.memory)."""

from __future__ import annotations

from pathlib import Path

import torch

import moerl.cluster.memory
from moerl.cli import main as cli_main
from moerl.cluster.memory import memory_warnings
from moerl.config import load_config
from moerl.instances import gpu_memory_gb
from moerl.rollout.memory_check import (
    MEMORY_HEADROOM,
    _param_bytes,
    engine_cache_bytes,
    ep_rank_weight_bytes,
    policy_arch,
    rollout_rank_weight_bytes,
    weight_bytes,
)

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


def test_fp8_weights_are_one_byte_plus_a_scale_per_128_block():
    shape = torch.Size([300, 200])
    assert _param_bytes("layers.1.self_attn.o_proj.weight", shape, "fp8", None) == 300 * 200 + 4 * 3 * 2
    assert _param_bytes("layers.1.self_attn.o_proj.weight", shape, "bf16", None) == 300 * 200 * 2
    assert _param_bytes("lm_head.weight", shape, "fp8", None) == 300 * 200 * 2  # kept in bf16
    assert _param_bytes("layers.1.mlp.router.weight", shape, "fp8", None) == 300 * 200 * 2
    assert _param_bytes("norm.weight", torch.Size([300]), "fp8", None) == 600
    experts = torch.Size([8, 256, 130])  # [E, out, in]: 2 of 8 experts kept by an EP rank
    assert _param_bytes("layers.1.mlp.experts.down_proj", experts, "fp8", 2) == 2 * (256 * 130 + 4 * 2 * 2)


def test_mission_recipe_is_deepseek_v3_with_an_mla_latent_cache_and_fits_with_fp8(monkeypatch):
    cfg = load_config(MISSION)
    arch = policy_arch(cfg, vocab_size=129280)
    assert (arch.kv_lora_rank, arch.q_lora_rank, arch.qk_rope_head_dim, arch.first_k_dense_replace) == (
        512,
        1536,
        64,
        3,
    )
    bf16 = rollout_rank_weight_bytes(arch, "bf16", 1)
    assert abs(bf16 / 2 - 671e9) < 0.005 * 671e9  # DeepSeek-V3: 671 B parameters (its MTP layer aside)
    assert rollout_rank_weight_bytes(arch, "bf16", 8) == ep_rank_weight_bytes(arch, torch.bfloat16, 8)
    # the KV cache: (kv_lora_rank + rope) x layers x 2 bytes per token, the engine's own allocation size
    _, tokens, kv = engine_cache_bytes(arch, cfg)
    assert kv == tokens * (512 + 64) * 61 * 2
    _, _, expanded = engine_cache_bytes(arch, load_config(MISSION, ["rollout.mla_cache=expanded"]))
    assert expanded == tokens * 128 * (192 + 128) * 61 * 2  # 71x the latent cache
    h200 = MEMORY_HEADROOM * gpu_memory_gb("p5en.48xlarge") * 1e9
    assert rollout_rank_weight_bytes(arch, "fp8", 8) + kv <= h200 < rollout_rank_weight_bytes(arch, "bf16", 8)
    # the bf16 variant: a 2-node group (EP 16) and half the cache fits as well
    _, _, kv16 = engine_cache_bytes(arch, load_config(MISSION, ["rollout.kv_token_budget=131072"]))
    assert rollout_rank_weight_bytes(arch, "bf16", 16) + kv16 <= h200
    # the render's rollout check with FP8 weights (rollout.weight_dtype, issue 34's FP8 half) warns not
    monkeypatch.setattr(moerl.cluster.memory, "rollout_weight_format", lambda cfg: "fp8")
    assert [w for w in memory_warnings(cfg) if w.startswith("cluster.rollout")] == []
