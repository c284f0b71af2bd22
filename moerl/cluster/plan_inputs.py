"""A run config as ``moerl plan`` parameters (``moerl plan --config RUN.yaml``): the model section and the
cluster section's node groups, with the run's own layout and batch.

    model         the planner preset with the model section's shapes (hidden size, layers, heads, experts,
                  top-k, expert width), else the config.json of ``init_from`` / ``model.path``
    hardware      the planner catalog's entry of ``cluster.rollout.instance_types[0]`` (``p5en.48xlarge``: p5en;
                  most of a run's nodes), else of ``cluster.train.instance_types[0]``
    train_nodes   ceil(trainer.num_ranks / trainer.gpus_per_node)
    total_nodes   train_nodes + the rollout nodes that hold rollout.num_workers EP groups of rollout.ep_size
    rollout_ep_nodes   nodes of one rollout worker's EP group (1 when it fits a node)
    prompts_per_step, group_size, response_len, max_staleness, mode, spot_rollout, checkpoint_every
                  trainer.batch_groups, rollout.group_size, rollout.max_new_tokens, runtime.max_staleness,
                  runtime.mode, cluster.rollout.spot, trainer.checkpoint_every
    snapshot_tokens, keep_partial   fleet.snapshot_tokens, fleet.keep_partial (the Spot loss model)

The planner prices one instance type for both groups; a rollout group of another type is named in the
notes (``plan_values``). ``router_groups`` / ``topk_groups`` stay the plan's (the run's router has none).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moerl.config import ConfigError, RunConfig
from moerl.models.build import arch_from_model_config
from moerl.models.config import MoeConfig
from moerl.placement import Placement
from moerl.plan.hardware import HARDWARE
from moerl.plan.models import MODELS, ModelShape
from moerl.tasks.tokenizer import load_run_tokenizer

_KEY = ("hidden_size", "num_layers", "num_heads", "num_experts", "top_k", "moe_intermediate_size")


def shape_of_arch(name: str, a: MoeConfig) -> ModelShape:
    """The planner's ``ModelShape`` of a Hugging Face MoE architecture (moerl's ``MoeConfig``)."""
    mla = a.kv_lora_rank > 0
    return ModelShape(
        name=name,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        num_layers=a.num_hidden_layers,
        num_dense_layers=a.first_k_dense_replace,
        dense_intermediate_size=a.intermediate_size if a.first_k_dense_replace else 0,
        attention="mla" if mla else "gqa",
        num_heads=a.num_attention_heads,
        num_kv_heads=0 if mla else a.num_key_value_heads,
        head_dim=a.head_dim,
        q_lora_rank=a.q_lora_rank or 0,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_dim=a.qk_nope_head_dim,
        qk_rope_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        num_experts=a.num_experts,
        top_k=a.num_experts_per_tok,
        num_shared_experts=a.shared_intermediate_size // max(1, a.moe_intermediate_size),
        moe_intermediate_size=a.moe_intermediate_size,
        tie_embeddings=a.tie_word_embeddings,
    )


def planner_model(cfg: RunConfig) -> str | ModelShape:
    """The preset name whose shapes are the model section's, else the shape read from the config.json of
    ``init_from`` or ``model.path``, else the fresh model the run would build from its model section
    (``arch_from_model_config``, the run tokenizer's vocabulary); the last two named after the run.

    Raises:
        ConfigError: the model section is not one a run can build (e.g. an unknown family), or the
            run's tokenizer cannot be loaded.
    """
    m = cfg.model
    mine = tuple(getattr(m, k) for k in _KEY)
    for shape in MODELS.values():
        if tuple(getattr(shape, k) for k in _KEY) == mine:
            return shape.name
    for folder in (cfg.init_from, m.path):
        if folder is not None and (Path(folder) / "config.json").is_file():
            arch = MoeConfig.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))
            return shape_of_arch(f"{cfg.name}-model", arch)
    vocab_size = load_run_tokenizer(cfg).vocab_size  # the embedding rows of the model a fresh run builds
    return shape_of_arch(f"{cfg.name}-model", arch_from_model_config(m, vocab_size))


def _hardware(cfg: RunConfig) -> tuple[str, list[str]]:
    """The catalog entry the plan prices (module docstring) and a note per group priced as another type."""
    c = cfg.cluster
    groups = {g: getattr(c, g).instance_types[0] for g in ("rollout", "train")}
    known = [g for g, kind in groups.items() if kind.split(".")[0] in HARDWARE]
    if not known:
        raise ConfigError(
            f"cluster.rollout/train.instance_types: {groups['rollout']}, {groups['train']}: the planner prices "
            f"{', '.join(HARDWARE)} instances only"
        )
    family = groups[known[0]].split(".")[0]
    notes = [
        f"cluster.{g}.instance_types[0]={kind}: planned as {family} (the planner prices one instance type)"
        for g, kind in groups.items()
        if kind.split(".")[0] != family
    ]
    return family, notes


def plan_values(cfg: RunConfig) -> tuple[dict, ModelShape | None, list[str]]:
    """Plan parameters of ``cfg`` (module docstring), the model shape to register when it is no preset
    (else None), and notes to print (assumptions the planner had to make).

    Raises:
        ConfigError: a model the planner cannot size (``planner_model``), no group of an instance type in
            its catalog.
    """
    c, t, r = cfg.cluster, cfg.trainer, cfg.rollout
    model = planner_model(cfg)
    hardware, notes = _hardware(cfg)
    gpus = HARDWARE[hardware].gpus_per_node
    placement = Placement.from_config(cfg)
    train_nodes = math.ceil(placement.trainer.num_ranks / t.gpus_per_node)
    ep_nodes = math.ceil(r.ep_size / gpus)
    rollout_nodes = math.ceil(r.num_workers * r.ep_size / gpus)
    values = {
        "hardware": hardware,
        "model": model if isinstance(model, str) else model.name,
        "train_nodes": train_nodes,
        "total_nodes": train_nodes + rollout_nodes,
        "rollout_ep_nodes": ep_nodes,
        "prompts_per_step": t.batch_groups,
        "group_size": r.group_size,
        "response_len": r.max_new_tokens,
        "max_staleness": cfg.runtime.max_staleness,
        "mode": placement.run_mode,
        "spot_rollout": c.rollout.spot,
        "snapshot_tokens": cfg.fleet.snapshot_tokens,
        "keep_partial": cfg.fleet.keep_partial,
        "checkpoint_every": max(1, t.checkpoint_every),
    }
    return values, None if isinstance(model, str) else model, notes
