"""``ShardedTrainer``: the one-process ``Trainer`` step on one rank of a sharded training group.

Every rank runs ``Trainer.train_step`` on its slice of the step's groups (whole groups; advantages
were computed over the whole batch before the split). The hooks make the math independent of the
number of ranks:

- loss normalizers: the step's loss-token and sequence counts, all-reduced (sum) over the ranks, so
  each rank's loss is its share of the one-rank loss and the summed gradients (FSDP2 reduce-scatter,
  sum) are the one-rank gradient;
- gradient clipping: the global L2 norm over every shard of every parameter (each element lives on
  exactly one rank: dense parameters are sharded over all ranks, experts over EP x dp), from the
  squared local norms all-reduced over the group;
- metrics: sums over the ranks; the algorithm figures (``moerl.trainer.algorithms``: mismatch weights,
  KL, value loss, explained variance, advantage whitening, expert loads) from sums and counts reduced
  over the ranks (``_all_reduce_sum``), so they are the global batch's;
- reference policy and critic: sharded like the policy and handed in (``moerl.trainer.distributed.algo_models``);
  the critic's gradient norm is global like the policy's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.trainer.batch import TrainBatch
from moerl.trainer.distributed.mesh import TrainMesh
from moerl.trainer.local import LocalTrainer


def global_grad_norm(parameters: list[torch.nn.Parameter], device: torch.device) -> float:
    """L2 norm of all gradients of a sharded model: sqrt(all_reduce(sum of squared local shards)).

    Collective over the default group. Parameters may be DTensors (their local shard counts) or plain
    tensors held by one rank only; an element held by several ranks would be counted several times.
    """
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in parameters:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += g.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    return math.sqrt(float(sq))


class ShardedTrainer(LocalTrainer):
    """``Trainer`` on one rank of the group in ``mesh`` (model from ``build_sharded_policy``).

    Args:
        model: this rank's sharded policy.
        cfg, algorithm, temperature, norm_length: as for ``Trainer``.
        mesh: the group's meshes.
        reference_model: this rank's shard of the frozen reference policy (``algorithm.kl_coef > 0``).
        value_model: this rank's shard of the critic's value model (estimator ``gae``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        algorithm: AlgorithmConfig,
        mesh: TrainMesh,
        *,
        temperature: float = 1.0,
        norm_length: int | None = None,
        reference_model: torch.nn.Module | None = None,
        value_model: torch.nn.Module | None = None,
    ) -> None:
        # No shared-prompt forward: its suffix pass sends gradients into the prefix pass's layers through
        # the captured keys/values, not through the layers' outputs, so FSDP2's pre-backward hook would
        # not re-gather those layers' parameters (a use of freed storage). The log-probs agree to float
        # rounding (``trainer.share_prompt``), so the one-rank run and this one still match.
        cfg = replace(cfg, share_prompt=False)
        self.mesh = mesh
        super().__init__(
            model,
            cfg,
            algorithm,
            temperature=temperature,
            norm_length=norm_length,
            reference_model=reference_model,
            value_model=value_model,
        )

    def _num_ranks(self) -> int:
        return self.mesh.num_ranks

    def _with_global_normalizers(self, batch: TrainBatch) -> TrainBatch:
        counts = torch.tensor([batch.num_tokens, batch.num_seqs], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return replace(batch, num_tokens=int(counts[0]), num_seqs=int(counts[1]))

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.device, torch.float64, copy=True)
        dist.all_reduce(out)  # collective: every rank calls it at the same point of the step
        return out.cpu()

    @torch.no_grad()
    def _clip_params_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        norm = global_grad_norm(params, self.device)
        # torch.nn.utils.clip_grad_norm_'s rule, so that one rank and R ranks scale alike
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
        return norm
