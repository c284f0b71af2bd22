"""The sharded trainer against the one-process trainer at the learning rates runs use, measured relative
to the weight update.

Metric (per step s of ``STEPS``, per parameter tensor p of the state dict):

    d(p, s) = ||W_sharded(p, s) - W_one(p, s)||_2 / ||W_one(p, s) - W_start(p)||_2

with ||.||_2 the Euclidean (Frobenius) norm over all elements of the tensor, computed in float64 from the
float32 weights; the figure is max over p and s. Tensors the one-rank run leaves exactly unchanged must be
exactly unchanged in the sharded run too (their ratio is undefined).

Bound, chosen from first principles before measuring: ``BOUND = 1e-4``. The two runs differ only in the
order of float32 sums (each rank accumulates its own micro-batches, then FSDP2 sums the partial gradients;
EP gathers an expert's tokens in another order; the squared-norm sum for clipping); the loss normalizers
are integer counts, exact. A float32 sum of N terms reordered changes by at most about 2 N u sum|t_i|
(u = 2^-24 = 6.0e-8); a gradient element here sums N ~ 256 contributions (16 samples x up to 14 tokens,
through a 32-wide hidden state), so with a cancellation factor sum|t_i| / |sum t_i| of 3 the gradient moves by
2 x 256 x 6e-8 x 3 = 9e-5 of itself in the worst case (~sqrt(N) u = 1e-6 typically). AdamW passes a relative
gradient change to the update at most one to one while |g| >> eps, and over 5 steps at small lr the
per-step errors add in the same proportion as the updates, so the ratio stays at that level: 1e-4. What this
argument does not cover, and the measurement tests, is (a) elements whose gradient is near zero, where
AdamW's normalization turns rounding noise into lr-sized updates, and (b) the feedback of a weight difference
into the next steps' gradients, which grows with lr.
"""

from __future__ import annotations

import torch
import trainer_cases

from moerl.config import AlgorithmConfig
from moerl.models import from_pretrained
from moerl.trainer.distributed.batching import split_by_groups
from moerl.trainer.distributed.mesh import build_mesh
from moerl.trainer.distributed.parallelize import build_sharded_policy
from moerl.trainer.distributed.publish import iter_full_tensors
from moerl.trainer.distributed.sharded import ShardedTrainer
from moerl.trainer.local import LocalTrainer

BOUND = 1e-4
LRS = (1e-4, 1e-3, 3e-3)
STEPS = trainer_cases.STEPS  # 5 steps of trainer_cases.batches()
LAYOUTS = {"dp2": (2, 1), "ep2": (2, 2), "dp2xep2": (4, 2)}  # name -> (ranks, ep_size)


def one_rank(folder: str, lr: float) -> dict:
    """The one-process trainer's weights before and after each step: ``{"start": {name: tensor},
    "steps": [{name: tensor}] * STEPS}`` (float32 CPU copies)."""
    torch.manual_seed(0)
    trainer = LocalTrainer(from_pretrained(folder), trainer_cases.trainer_config(lr=lr), AlgorithmConfig())
    start = {k: v.clone() for k, v in trainer.named_weights().items()}
    steps = []
    for batch in trainer_cases.batches():
        trainer.train_step(batch)
        steps.append({k: v.clone() for k, v in trainer.named_weights().items()})
    return {"start": start, "steps": steps}


def sharded(rank: int, world: int, folder: str, ep_size: int, lrs: tuple[float, ...]) -> dict | None:
    """One rank of the sharded trainer (alltoall dispatcher), a fresh model per lr, the same batches; rank 0
    returns ``{lr: [{name: full tensor}] * STEPS}`` (gathered after each step), other ranks None."""
    mesh = build_mesh(ep_size, 8)
    out = {}
    for lr in lrs:
        torch.manual_seed(0)
        model = build_sharded_policy(folder, mesh, ep_dispatcher="alltoall")
        trainer = ShardedTrainer(model, trainer_cases.trainer_config(lr=lr), AlgorithmConfig(), mesh)
        steps = []
        for batch in trainer_cases.batches():
            trainer.train_step(split_by_groups(batch, world)[rank])
            steps.append(dict(iter_full_tensors(model)))  # collective: every rank gathers
        out[lr] = steps
    return out if rank == 0 else None


def distance(one: dict, sharded_steps: list[dict]) -> tuple[float, str, int]:
    """The metric (module docstring): (max over tensors and steps of d(p, s), the tensor, the step 1..STEPS).
    Raises AssertionError when the name sets differ or a tensor the one-rank run left unchanged moved."""
    worst = (0.0, "", 0)
    for s, (want, got) in enumerate(zip(one["steps"], sharded_steps, strict=True), start=1):
        assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
        for name, w in want.items():
            update = float(torch.linalg.vector_norm((w - one["start"][name]).double()))
            gap = float(torch.linalg.vector_norm((got[name] - w).double()))
            if update == 0.0:
                assert gap == 0.0, f"{name} step {s}: unchanged at one rank, moved by {gap:.3e} sharded"
                continue
            worst = max(worst, (gap / update, name, s))
    return worst
