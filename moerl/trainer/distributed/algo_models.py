"""The sharded trainer's other models: the frozen reference policy and the critic's value model.

Both are built like the policy (``build_sharded_policy``: meta device -> EP -> FSDP2 -> this rank's
shards read from the start folder), so each rank holds only its shards and their forwards run the same
collectives as the policy's: the reference for ``algorithm.kl_coef > 0`` (frozen, no optimizer, no
gradient), the value model (the policy's trunk with PPO's zero-initialized value head, its own AdamW in
``moerl.trainer.critic.Critic``) for the ``gae`` estimator. Loaded from the folder RL starts from, they
equal the one-rank trainer's copies of the start policy (``moerl.trainer.algorithms.AlgoParts.build``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moerl.config import AlgorithmConfig
from moerl.rl import preset_from_config
from moerl.trainer.distributed.mesh import TrainMesh
from moerl.trainer.distributed.parallelize import build_sharded_policy


def build_algo_models(
    folder: str | Path,
    mesh: TrainMesh,
    algorithm: AlgorithmConfig,
    *,
    ep_dispatcher: str = "alltoall",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.nn.Module]:
    """``{"reference_model": ..., "value_model": ...}``, the ones ``algorithm`` needs (keyword arguments of
    ``ShardedTrainer``), sharded over ``mesh`` from the Hugging Face folder ``folder`` (collective: every
    rank calls it with the same arguments).

    Raises:
        CheckpointError, ValueError: as ``build_sharded_policy``.
    """
    kwargs = {"ep_dispatcher": ep_dispatcher, "dtype": dtype, "device": device}
    out: dict[str, torch.nn.Module] = {}
    if algorithm.kl_coef > 0:
        reference = build_sharded_policy(folder, mesh, **kwargs)
        for p in reference.parameters():
            p.requires_grad_(False)
        out["reference_model"] = reference.eval()
    if preset_from_config(algorithm).estimator == "gae":
        out["value_model"] = build_sharded_policy(folder, mesh, value_head=True, **kwargs)
    return out
