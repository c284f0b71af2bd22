"""``moerl cluster render`` warns of GPUs the run would overfill (moerl.cluster.memory)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import moerl.cluster.memory
from moerl.cli import main as cli_main
from moerl.cluster.memory import memory_warnings
from moerl.cluster.render import cluster_run_config
from moerl.config import load_config
from moerl.configlib import ConfigError
from moerl.instances import gpu_memory_gb
from moerl.placement import Placement
from moerl.rollout import memory_check
from moerl.rollout.memory_check import (
    MEMORY_HEADROOM,
    _param_bytes,
    engine_cache_bytes,
    ep_rank_weight_bytes,
    policy_arch,
    rollout_rank_weight_bytes,
    weight_bytes,
)
from moerl.run.preflight import check_run_inputs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN, MISSION = CONFIGS / "cluster_qwen3_30b_1node.yaml", CONFIGS / "cluster_mission.yaml"
MISSION_BF16 = CONFIGS / "cluster_mission_bf16_2node.yaml"


def _cache_bytes(arch, cfg) -> int:
    """One engine's KV cache bytes of ``cfg`` (its own cache kind)."""
    return engine_cache_bytes(arch, cfg, cfg.rollout.kv_cache)[2]


IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""


def test_an_ep_rank_holds_the_shared_parameters_and_its_share_of_the_routed_experts():
    arch = policy_arch(load_config(QWEN, [IMAGE, IMAGE]), vocab_size=1)
    routed = 48 * 128 * 3 * 2048 * 768  # Qwen3-30B-A3B: layers x experts x (gate, up, down) x d x width
    full = weight_bytes(arch, torch.bfloat16)
    assert ep_rank_weight_bytes(arch, torch.bfloat16, 1) == full
    assert ep_rank_weight_bytes(arch, torch.bfloat16, 2) == full - routed * 2 + routed * 2 // 2  # bf16: 2 B
    assert gpu_memory_gb("g6e.12xlarge") == 48.0 and gpu_memory_gb("m7i.8xlarge") is None


def test_the_recipes_fit_and_an_overfull_gpu_is_warned_of():
    for recipe in (QWEN, MISSION, MISSION_BF16):
        assert memory_warnings(load_config(recipe, [IMAGE])) == [], recipe
    # the mission's engine in bf16 at EP 8 on one node: the rollout group
    (rollout,) = memory_warnings(load_config(MISSION, [IMAGE, "rollout.weight_dtype=bf16"]))
    assert rollout.startswith("cluster.rollout: a rollout EP rank (rollout.ep_size=8)")
    assert "p5e.48xlarge GPU's 141 GB: the rollout workers would run out of memory" in rollout
    # a one-process trainer: the driver holds the whole policy (a worker evaluates: no eval engine)
    (train,) = memory_warnings(load_config(MISSION, ["trainer.num_ranks=1", "trainer.ep_size=1"]))
    assert train.startswith("cluster.train: the driver holds a full") and "refuses it at start" in train
    assert "(trainer.num_ranks=1) on GPU 0" in train and "eval engine" not in train
    # a cache too large for an L40S beside the EP rank's weights: the rollout group only
    (line,) = memory_warnings(
        load_config(QWEN, [IMAGE, "rollout.kv_token_budget=262144", "rollout.max_slots=128"])
    )
    assert line.startswith("cluster.rollout:") and "24.0 GiB KV cache" in line


@pytest.mark.parametrize("recipe", [MISSION, MISSION_BF16])
def test_render_of_the_mission_recipes_warns_of_nothing(recipe, tmp_path, capsys):
    assert (
        cli_main(["cluster", "render", "--set", IMAGE, "--config", str(recipe), "--out", str(tmp_path)]) == 0
    )
    out = capsys.readouterr()
    assert "warning" not in out.err and (tmp_path / "k8s" / "30-rayjob.yaml").exists()


def test_render_prints_the_warnings_and_still_writes(tmp_path, capsys):
    overfull = tmp_path / "overfull.yaml"
    overfull.write_text(MISSION.read_text().replace("weight_dtype: fp8", "weight_dtype: bf16"))
    assert (
        cli_main(
            ["cluster", "render", "--set", IMAGE, "--config", str(overfull), "--out", str(tmp_path / "out")]
        )
        == 0
    )
    out = capsys.readouterr()
    assert (
        out.err.count("warning: cluster.rollout") == 1
        and (tmp_path / "out" / "k8s" / "30-rayjob.yaml").exists()
    )


@pytest.mark.parametrize("recipe", [MISSION, MISSION_BF16])
def test_moerl_trains_memory_check_accepts_the_mission_recipes(recipe, monkeypatch):
    """The load-time check (``check_run_inputs``) on the job's config as rendered (async on the Ray
    cluster, the model on CUDA), on GPU 0 of a p5.48xlarge train node (80 GB): no weights here, the
    policy's shapes from ``model.*`` (a meta-device model)."""
    cfg = cluster_run_config(load_config(recipe, [IMAGE]))
    cfg.init_from = None  # the train pods' copy is absent here: DeepSeek-V3's shapes from model.*
    h100 = int(gpu_memory_gb("p5.48xlarge") * 1e9)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (h100, "p5.48xlarge datasheet"))
    check_run_inputs(cfg)
    est = memory_check.estimate_memory(cfg, Placement.from_config(cfg), 129280)
    assert (est.device, est.num_engines, est.num_copies) == ("cuda:0", 0, 0)  # no driver copy, no engine
    placed = Placement.from_config(cfg)
    evaluating = replace(placed, driver=replace(placed.driver, evaluates_later=True))  # the driver evaluating
    monkeypatch.setattr(Placement, "from_config", classmethod(lambda cls, c: evaluating))
    with pytest.raises(ConfigError, match=r"GiB of cuda:0 memory \(1 rollout engine KV cache"):
        check_run_inputs(cfg)


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
    _, tokens, kv = engine_cache_bytes(arch, cfg, cfg.rollout.kv_cache)
    assert kv == tokens * (512 + 64) * 61 * 2
    expanded = _cache_bytes(arch, load_config(MISSION, ["rollout.mla_cache=expanded"]))
    assert expanded == tokens * 128 * (192 + 128) * 61 * 2  # 71x the latent cache
    h200 = MEMORY_HEADROOM * gpu_memory_gb("p5en.48xlarge") * 1e9
    assert rollout_rank_weight_bytes(arch, "fp8", 8) + kv <= h200 < rollout_rank_weight_bytes(arch, "bf16", 8)
    # the bf16 variant: a 2-node group (EP 16) and half the cache fits as well
    kv16 = _cache_bytes(arch, load_config(MISSION, ["rollout.kv_token_budget=131072"]))
    assert rollout_rank_weight_bytes(arch, "bf16", 16) + kv16 <= h200
    # the render's rollout check with FP8 weights (rollout.weight_dtype, issue 34's FP8 half) warns not
    monkeypatch.setattr(moerl.cluster.memory, "rollout_weight_format", lambda cfg, placement: "fp8")
    assert [w for w in memory_warnings(cfg) if w.startswith("cluster.rollout")] == []
