"""The trainer's algorithm parts (reference KL, PPO's critic, R3 routing replay, aux loss) at R ranks and
at one rank: the same tiny policy and batches as ``trainer_cases``, two steps per case.

Each case returns, per step, the losses and every ``AlgoStats`` figure, and at the end the full policy
weights and (PPO) the critic's value-model weights, so the test can compare R ranks with one.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch
import trainer_cases

from moerl.config import AlgorithmConfig
from moerl.models import from_pretrained
from moerl.trainer.distributed.algo_models import build_algo_models
from moerl.trainer.distributed.batching import split_by_groups
from moerl.trainer.distributed.mesh import build_mesh
from moerl.trainer.distributed.parallelize import build_sharded_policy
from moerl.trainer.distributed.publish import iter_full_tensors
from moerl.trainer.distributed.sharded import ShardedTrainer
from moerl.trainer.local import LocalTrainer

STEPS = 2
CASES = {  # name: (algorithm fields, trainer overrides, with recorded experts)
    "kl": ({"kl_coef": 0.05}, {}, False),
    "kl_in_reward": ({"kl_coef": 0.05, "kl_in_reward": True, "kl_kind": "k1"}, {}, False),
    "ppo": ({"preset": "ppo"}, {}, False),
    "ppo_kl_epochs": (
        {"preset": "ppo", "kl_coef": 0.05},
        {"ppo_epochs": 2, "mini_batches": 2, "recompute_proximal": True},
        False,
    ),
    "r3": ({"routing_replay": "r3"}, {}, True),
    "aux_loss": ({}, {"aux_loss_coef": 0.01}, False),
}
STAT_KEYS = ("pg_loss", "grad_norm", "aux_loss", "entropy", "pg_clipfrac")
LR = 3e-5
"""AdamW turns float32 rounding of near-zero gradients into updates of size ~lr (trainer_cases): at 1e-4
the aux-loss case's weights agreed only within 9e-6 relative, near the test's 1e-5."""


def _batches(with_experts: bool):
    """``trainer_cases.batches()``, with random recorded experts (distinct top-k per token, not what the
    router would pick) when ``with_experts``."""
    out = trainer_cases.batches()
    if not with_experts:
        return out
    gen = torch.Generator().manual_seed(3)
    cfg = trainer_cases.MODEL
    experts = []
    for b in out:
        n, t = b.input_ids.shape
        scores = torch.rand(n, t, cfg.num_layers, cfg.num_experts, generator=gen)
        experts.append(replace(b, routed_experts=scores.topk(cfg.top_k, dim=-1).indices))
    return experts


def _record(stats) -> dict:
    row = {k: getattr(stats, k) for k in STAT_KEYS}
    row.update(
        {f"algo/{k}": v for k, v in asdict(stats.algo).items() if k != "expert_load_max_min_per_layer"}
    )
    return row


def _algorithm(name: str) -> AlgorithmConfig:
    return AlgorithmConfig(**CASES[name][0])


def reference(folder, name: str) -> dict:
    """One process, the one-rank ``Trainer``, without the shared-prompt forward (the sharded trainer has
    none; with it the log-probs agree to rounding but the aux loss counts each group's prompt once)."""
    _, overrides, with_experts = CASES[name]
    torch.manual_seed(0)
    cfg = trainer_cases.trainer_config(lr=LR, **overrides, share_prompt=False)
    trainer = LocalTrainer(from_pretrained(folder), cfg, _algorithm(name))
    rows = [_record(trainer.train_step(b)) for b in _batches(with_experts)]
    critic = trainer.algo.critic
    return {
        "steps": rows,
        "weights": {k: v.clone() for k, v in trainer.named_weights().items()},
        "critic": None if critic is None else {k: v.clone() for k, v in critic.model.state_dict().items()},
    }


def run_sharded(rank: int, world: int, folder: str, ep_size: int, names: list[str]) -> dict:
    """Every case in ``names`` at ``world`` ranks, EP size ``ep_size``; rank 0 returns full weights."""
    mesh = build_mesh(ep_size, 8)
    out = {}
    for name in names:
        _, overrides, with_experts = CASES[name]
        torch.manual_seed(0)
        algorithm = _algorithm(name)
        model = build_sharded_policy(folder, mesh)
        others = build_algo_models(folder, mesh, algorithm)
        trainer = ShardedTrainer(
            model, trainer_cases.trainer_config(lr=LR, **overrides), algorithm, mesh, **others
        )
        minis = trainer.cfg.mini_batches
        rows = [
            _record(trainer.train_step(split_by_groups(b, world, minis)[rank]))
            for b in _batches(with_experts)
        ]
        weights = dict(iter_full_tensors(model))
        critic = None
        if trainer.algo.critic is not None:
            critic = dict(iter_full_tensors(trainer.algo.critic.model))
        out[name] = {
            "steps": rows,
            "weights": weights if rank == 0 else None,
            "critic": critic if rank == 0 else None,
        }
    return out
