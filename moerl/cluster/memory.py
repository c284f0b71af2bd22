"""What the rendered run will need of its GPUs' memory, told at ``moerl cluster render`` (before any node
is rented): a rollout EP rank's share of the policy plus its engine's KV cache on a rollout GPU, and the
driver's full policy copy plus its eval engine on GPU 0 of a train node when the driver holds them (sync
mode; in async mode a rollout worker evaluates, and only a one-process trainer's model stays there). The same figures as the load-time
check (``moerl.rollout.memory_check``), which refuses an overfull driver when ``moerl train`` starts on the
cluster (the workers' engines would run out of memory when built); here they are warnings: the render has
no GPU to measure, only the instance types' datasheet memory.
"""

from __future__ import annotations

from moerl.config import RunConfig
from moerl.instances import gpu_memory_gb
from moerl.models.dtypes import torch_dtype
from moerl.placement import Placement
from moerl.rollout.memory_check import (
    GIB,
    MEMORY_HEADROOM,
    engine_cache_bytes,
    policy_arch,
    rollout_rank_weight_bytes,
    rollout_weight_format,
    weight_bytes,
)


def _smallest_gpu_gb(instance_types: tuple[str, ...]) -> tuple[float, str] | None:
    """(GB, instance type) of the group's smallest GPU; None when no type's GPU is listed."""
    sizes = [(gb, t) for t in instance_types if (gb := gpu_memory_gb(t)) is not None]
    return min(sizes) if sizes else None


def memory_warnings(cfg: RunConfig) -> list[str]:
    """One line for each GPU the run as configured would overfill (at most ``MEMORY_HEADROOM`` of the
    datasheet memory counts as usable), [] when both fit. The vocabulary's embeddings are counted at the
    config's ``model`` shapes with a 1-token vocabulary, so the figures are lower bounds."""
    arch = policy_arch(cfg, vocab_size=1)
    if arch is None or cfg.cluster is None:
        return []
    dtype = torch_dtype(cfg.model.dtype)
    placement = Placement.from_config(cfg)
    _, _, engine = engine_cache_bytes(arch, cfg, placement.rollout.cache_kind)
    r = cfg.rollout
    fmt = rollout_weight_format(cfg, placement)
    needs = [  # (group, its instance types, weight bytes, KV cache bytes one GPU holds, what, what follows)
        (
            "rollout",
            cfg.cluster.rollout.instance_types,
            rollout_rank_weight_bytes(arch, fmt, r.ep_size),
            engine,
            f"a rollout EP rank (rollout.ep_size={r.ep_size}) holds {{w:.1f}} GiB of the policy ({fmt}) plus its "
            f"engine's {engine / GIB:.1f} GiB KV cache (rollout.max_slots, rollout.kv_token_budget)",
            "the rollout workers would run out of memory",
        ),
    ]
    if placement.driver.holds_policy:  # sync mode, or the one-process trainer's model (async: no copy)
        cache = engine if placement.driver.evaluates_start else 0  # else a rollout worker evaluates v0 too
        needs.append(
            (
                "train",
                cfg.cluster.train.instance_types,
                weight_bytes(arch, dtype),
                cache,
                "the driver holds a full {w:.1f} GiB copy of the policy"
                + (
                    f" plus its eval engine's {cache / GIB:.1f} GiB KV cache"
                    if cache
                    else " (trainer.num_ranks=1)"
                )
                + " on GPU 0 of a train node",
                "moerl train's memory check refuses it at start",
            )
        )
    out = []
    for group, types, weights, cache, what, outcome in needs:
        gpu = _smallest_gpu_gb(types)
        if gpu is None or weights + cache <= MEMORY_HEADROOM * gpu[0] * 1e9:
            continue
        out.append(
            f"cluster.{group}: {what.format(w=weights / GIB)}: {(weights + cache) / GIB:.1f} GiB, more than "
            f"{MEMORY_HEADROOM:.0%} of a {gpu[1]} GPU's {gpu[0]:.0f} GB: {outcome}"
        )
    return out
