"""``parallelize``: shard each MoE block's routed experts across the EP ranks, model code unchanged.

Shape legend: N tokens on this rank, H hidden size, k top-k, E routed experts, L = E / R local
experts, I expert intermediate size, M received (token, local expert) copies.

The model's MoE seam (docs/architecture.md): each block calls ``experts(x [N, H], topk_idx [N, k],
topk_weights [N, k]) -> [N, H]``. ``ExpertParallelExperts`` keeps that signature but holds only the
L local experts and runs dispatch -> grouped GEMM -> combine. Everything else (attention, router,
shared experts, embeddings) stays replicated; its gradients must be all-reduced over the EP group by
the caller like any data-parallel gradient, while expert gradients are already complete per rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from moerl.ep.dispatcher import Dispatcher
from moerl.ep.registry import DISPATCHERS, build_dispatcher
from moerl.ep.topology import Topology
from moerl.models.fp8 import SCALE_SUFFIX, Fp8Experts, dequantize_blockwise
from moerl.models.fp8_kernels import fp8_grouped_mm, fp8_mm_supported
from moerl.models.kernels import small_grouped_mm, small_grouped_mm_supported, swiglu

__all__ = ["DISPATCHERS", "ExpertParallelExperts", "parallelize", "replicated_parameters"]


class ExpertParallelExperts(nn.Module):
    """Drop-in replacement of ``moerl.models.moe.Experts`` holding this rank's L experts.

    Parameters ``gate_up_proj [L, 2I, H]`` and ``down_proj [L, H, I]`` are copies of the global
    experts ``dispatcher.local_experts`` (global ids in local order, also in ``local_expert_ids``).
    From an ``Fp8Experts`` (``rollout.weight_dtype=fp8``) they are FP8 buffers with their block scales
    ``gate_up_proj_scale_inv [L, 2I/128, H/128]``, ``down_proj_scale_inv [L, H/128, I/128]`` (inference only).
    """

    def __init__(self, experts: nn.Module, dispatcher: Dispatcher) -> None:
        super().__init__()
        local = dispatcher.local_experts
        self.dispatcher = dispatcher
        self.is_fp8 = isinstance(experts, Fp8Experts)
        for name in ("gate_up_proj", "down_proj"):
            shard = getattr(experts, name).detach()[local].clone()
            if self.is_fp8:  # FP8 rollout weights (moerl.models.fp8): buffers, with their block scales
                self.register_buffer(name, shard)
                scales = getattr(experts, name + SCALE_SUFFIX).detach()[local].clone()
                self.register_buffer(name + SCALE_SUFFIX, scales)
            else:
                setattr(self, name, nn.Parameter(shard))
        self.use_grouped_mm = getattr(experts, "use_grouped_mm", None)
        self.register_buffer("local_expert_ids", local.clone(), persistent=False)

    def _local_mlp(self, recv_x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The local experts' SwiGLU on expert-sorted rows [M, H] -> [M, H]. FP8 shards: the Triton FP8
        GEMMs where they serve (CUDA bf16), else the reference (dequantize, then the same math)."""
        from moerl.models.moe import grouped_expert_mlp  # the model's expert math, shared with EP=1

        gate_up, down = self.gate_up_proj, self.down_proj
        if self.is_fp8 and fp8_mm_supported(recv_x):
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            act = swiglu(fp8_grouped_mm(recv_x, gate_up, self.gate_up_proj_scale_inv, offsets))
            return fp8_grouped_mm(act, down, self.down_proj_scale_inv, offsets)
        if self.is_fp8:
            gate_up = dequantize_blockwise(gate_up, self.gate_up_proj_scale_inv, recv_x.dtype)
            down = dequantize_blockwise(down, self.down_proj_scale_inv, recv_x.dtype)
        if small_grouped_mm_supported(recv_x, gate_up):  # decode sizes, no gradient: as EP = 1
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            act = swiglu(small_grouped_mm(recv_x, gate_up, offsets))
            return small_grouped_mm(act, down, offsets)
        return grouped_expert_mlp(
            recv_x, tokens_per_expert, gate_up, down, use_grouped_mm=self.use_grouped_mm
        )

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], topk_idx [N, k] int64 (global expert ids), topk_weights [N, k] float32 -> [N, H] in
        x's dtype. Collective over the EP group (every rank calls it, also with N = 0)."""
        recv_x, handle = self.dispatcher.dispatch(x, topk_idx, topk_weights)
        y = self._local_mlp(recv_x, handle.tokens_per_local_expert)
        return self.dispatcher.combine(y, handle).to(x.dtype)


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "moe_blocks"):
        return list(model.moe_blocks())
    return [m for m in model.modules() if hasattr(getattr(m, "experts", None), "gate_up_proj")]


def parallelize(
    model: nn.Module,
    ep_group: dist.ProcessGroup | None = None,
    *,
    dispatcher: str | Dispatcher = "hierarchical",
    topology: Topology | None = None,
    placement: str = "contiguous",
) -> nn.Module:
    """Replace every MoE block's ``experts`` by an ``ExpertParallelExperts`` shard, in place.

    Every rank must hold the same (full) model weights when this is called; each keeps its slice.

    Args:
        model: a model with ``moe_blocks()`` (``MoeForCausalLM``) or blocks with an ``experts`` module
            holding ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.
        ep_group: the EP process group; None = the default group.
        dispatcher: a name of ``moerl.ep.registry.DISPATCHERS`` (``"hierarchical"``, ``"alltoall"``), or a
            built ``Dispatcher`` (shared by all layers).
        topology: node layout of the EP ranks; default: ``LOCAL_WORLD_SIZE`` ranks per node (torchrun
            sets it), else a single node.
        placement: expert placement for a dispatcher built here (``contiguous`` or ``round_robin``).
    Returns:
        the same model object.
    Raises:
        ValueError: no MoE block, unknown dispatcher name, E not a multiple of the EP size, or a
            given dispatcher whose expert count differs from the model's.
    """
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError("parallelize: the model has no MoE block with an `experts` module")
    num_experts = blocks[0].experts.gate_up_proj.shape[0]
    if isinstance(dispatcher, str):
        if dispatcher not in DISPATCHERS:  # before the topology: a typo is reported as such
            raise ValueError(f"unknown dispatcher {dispatcher!r}; choose one of {sorted(DISPATCHERS)}")
        if topology is None:
            size = dist.get_world_size(ep_group)
            topology = Topology(size, int(os.environ.get("LOCAL_WORLD_SIZE", size)))
        dispatcher = build_dispatcher(dispatcher, topology, num_experts, ep_group, placement=placement)
    if dispatcher.num_experts != num_experts:
        raise ValueError(f"dispatcher has {dispatcher.num_experts} experts but the model has {num_experts}")
    for block in blocks:
        block.experts = ExpertParallelExperts(block.experts, dispatcher)
    return model


def replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that is NOT an expert shard: the ones every EP rank holds a
    full copy of, whose gradients the caller must all-reduce over the EP group (data parallelism)."""
    sharded = {id(p) for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in sharded]
