"""The load-time memory estimate (``moerl.rollout.memory_check``): the engine's own cache and weight
bytes, the engines each mode builds on the checked device, and the refusal against what is available."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerl.config import ConfigError, load_config
from moerl.models import build_model
from moerl.placement import Placement
from moerl.rollout import memory_check
from moerl.rollout.memory_check import (
    MEMORY_HEADROOM,
    check_memory,
    engine_cache_bytes,
    estimate_memory,
    host_available_bytes,
    policy_arch,
    residents,
    weight_bytes,
)
from moerl.run.preflight import check_run_inputs
from moerl.runtime.build import make_engine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB = 20


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # 2 layers x 2 kv heads x (16 + 16) dims x 4 bytes = 512 bytes a token; 64 // 4 = 16 tokens a slot
        (["rollout.kv_cache=slots"], 4 * 16 * 512),
        # bfloat16 halves it; R3 adds 4 x 16 tokens x 2 MoE layers x top-2 x int32
        (
            ["rollout.kv_cache=slots", "model.dtype=bfloat16", "algorithm.routing_replay=r3"],
            4 * 16 * 256 + 4 * 16 * 2 * 2 * 4,
        ),
        # MLA (deepseek_v3), expanded: keys and values decompressed, 4 heads x (16 + 8 + 16) dims; 100 // 4 = 25
        (
            [
                "rollout.kv_cache=slots",
                "model.family=deepseek_v3",
                "rollout.kv_token_budget=100",
                "rollout.mla_cache=expanded",
            ],
            4 * 25 * 2 * 4 * 40 * 4,
        ),
        # MLA, latent (the default): kv_lora_rank 32 + rope 8 values a layer, one "head", no values
        (
            ["rollout.kv_cache=slots", "model.family=deepseek_v3", "rollout.kv_token_budget=100"],
            4 * 25 * 2 * (32 + 8) * 4,
        ),
        (["model.family=deepseek_v3", "model.kv_lora_rank=12"], 5 * 16 * 2 * (12 + 8) * 4),  # paged
        # paged (the default): 64 // 16 = 4 blocks of 16 tokens plus the null block, whatever max_slots
        ([], 5 * 16 * 512),
        (["model.dtype=bfloat16", "algorithm.routing_replay=r3"], 5 * 16 * 256 + 5 * 16 * 2 * 2 * 4),
        (["rollout.kv_block_size=8", "rollout.kv_token_budget=100"], 13 * 8 * 512),
    ],
)
def test_estimate_equals_what_the_engine_allocates(overrides, expected):
    sizes = ["rollout.max_slots=4", "rollout.kv_token_budget=64", "rollout.max_new_tokens=4"]
    cfg = load_config(None, [*sizes, *overrides])
    arch = policy_arch(cfg, VOCAB)
    _, _, estimated = engine_cache_bytes(arch, cfg, cfg.rollout.kv_cache)
    model = build_model(cfg.model, VOCAB)
    engine = make_engine(model, cfg)
    cache = engine.cache
    allocated = cache.k.nbytes + cache.v.nbytes
    if cfg.rollout.return_routed_experts:  # allocated at the first recording step
        allocated += cache.ensure_routed(
            len(model.config.moe_layer_ids), model.config.num_experts_per_tok
        ).nbytes
    assert estimated == allocated == expected
    assert weight_bytes(arch, next(model.parameters()).dtype) == sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize(
    ("overrides", "device", "rollouts", "expected"),
    [
        (["runtime.mode=sync"], "cpu", True, (2, 2)),  # trainer + eval engine, the worker's copy + engine
        (["runtime.mode=sync"], "cpu", False, (1, 1)),  # moerl sft: its model and the eval engine
        # async: the driver's copy is the one-process trainer's model, and its eval engine evaluates
        # version 0 while the workers start; a rollout worker evaluates the later versions
        (["rollout.num_workers=3"], "cpu", True, (4, 4)),  # local Ray: every worker on this host
        (["rollout.num_workers=3", "rollout.ep_size=2"], "cpu", True, (7, 4)),  # an engine per EP rank
        (["rollout.num_workers=3"], "cuda", True, (2, 2)),  # Ray gives each worker a GPU of its own
        (
            ["rollout.num_workers=3", "runtime.ray_address=10.0.0.1:6379"],
            "cpu",
            True,
            (1, 1),
        ),  # on the cluster
        # FP8 rollout weights: a worker evaluates version 0 too (the weights it samples from)
        (["rollout.num_workers=3", "rollout.weight_dtype=fp8"], "cuda", True, (1, 2)),
        (["trainer.num_ranks=2"], "cuda", True, (1, 1)),  # a trainer group: no driver copy or eval engine
        (
            ["runtime.ray_address=10.0.0.1:6379", "trainer.num_ranks=2"],
            "cuda",
            True,
            (0, 0),
        ),  # a trainer group on the cluster: the driver holds no policy at all
        (["rollout.num_workers=3"], "cpu", False, (1, 1)),  # moerl sft in any mode: its own eval
        (["runtime.mode=sync", "trainer.num_ranks=2"], "cpu", True, (2, 3)),  # + the ranks' shards
    ],
)
def test_engines_and_copies_on_the_checked_device(overrides, device, rollouts, expected):
    cfg = load_config(None, overrides)
    assert residents(Placement.from_config(cfg), torch.device(device), rollouts=rollouts) == expected


def test_refused_only_beyond_the_headroom_of_what_is_available(monkeypatch):
    cfg = load_config(None, ["runtime.mode=sync"])
    need = estimate_memory(cfg, Placement.from_config(cfg), VOCAB).total_bytes
    fits = int(need / MEMORY_HEADROOM) + 1
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (fits, "test"))
    assert check_memory(cfg, Placement.from_config(cfg), VOCAB).total_bytes == need
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (fits - 2, "test"))
    with pytest.raises(
        ConfigError, match=r"^rollout.max_slots=64, rollout.kv_token_budget=16384: the run needs"
    ):
        check_memory(cfg, Placement.from_config(cfg), VOCAB)


def test_host_available_memory_is_at_most_the_total():
    available, source = host_available_bytes()
    total_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert 0 < available <= total_kb * 1024 and source


def test_cluster_configs_load_here_and_are_measured_only_where_the_engines_are_built():
    # configs/cluster_qwen3_30b_1node.yaml: 30.5e9 bf16 parameters and a paged cache of 32 x 2048 tokens
    # (plus the null block of 16) of 48 layers x 4 kv heads x 256 dims x 2 bytes per engine; it loads
    # (and renders) on any machine
    cfg = load_config(CONFIGS / "cluster_qwen3_30b_1node.yaml")
    est = estimate_memory(cfg, Placement.from_config(cfg), 151936)
    assert est.engine_bytes == (32 * 2048 + 16) * 48 * 4 * 256 * 2
    assert est.weight_bytes == 30_532_122_624 * 2
    if est.total_bytes > MEMORY_HEADROOM * host_available_bytes()[0]:  # not a 600 GiB machine
        with pytest.raises(ConfigError, match="GiB of host memory"):
            check_memory(cfg, Placement.from_config(cfg), 151936)


@pytest.mark.parametrize("config", ["default.yaml", "env_calculator.yaml", "env_guess.yaml"])
def test_the_configs_for_this_machine_pass(config):
    check_run_inputs(load_config(CONFIGS / config))
