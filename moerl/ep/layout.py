"""Dispatch layout: where each token of this rank must go, computed once from ``topk_idx``.

Shape legend: T tokens on this rank, k experts per token (top-k), E routed experts, R EP ranks,
N nodes, G ranks per node. ``topk_idx`` entries equal to -1 mean "no expert in this slot".

The same functions serve the dispatchers at run time and ``bench/ep_traffic.py`` (which lays out
64 simulated ranks in one process), so the bytes the bench predicts are the bytes the dispatchers send.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology


@dataclass(frozen=True)
class Layout:
    """Routing of T tokens resolved to EP ranks and nodes (see ``compute_layout``)."""

    topk_rank: torch.Tensor
    """[T, k] int64: EP rank owning each slot's expert, -1 for empty slots."""
    topk_local: torch.Tensor
    """[T, k] int64: local-expert index of each slot on its rank, -1 for empty slots."""
    is_token_in_rank: torch.Tensor
    """[T, R] bool: token t has at least one expert on rank r."""
    is_token_in_node: torch.Tensor
    """[T, N] bool: token t has at least one expert on node n."""
    tokens_per_rank: torch.Tensor
    """[R] int64: tokens (not copies) that rank r needs = is_token_in_rank.sum(0)."""
    tokens_per_node: torch.Tensor
    """[N] int64: tokens that node n needs = is_token_in_node.sum(0)."""
    tokens_per_expert: torch.Tensor
    """[E] int64: (token, slot) copies routed to each expert."""


def check_topk_idx(
    x_shape: tuple[int, ...],
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    x_device: torch.device | None = None,
    *,
    check_range: bool = True,
) -> str | None:
    """Describe what is wrong with one rank's dispatch inputs, or None if they are valid. Never raises,
    so that a rank with bad input still reaches the collective that shares the verdict.

    Checks: x is [T, H]; all three on ``x_device`` (when given); topk_idx is int64 [T, k]; topk_weights
    is [T, k]; ids lie in [-1, E) (only with ``check_range``: that check reads the device; the dispatchers
    leave it to ``moerl.ep.comm.exchange_counts``, which does it in the counts exchange's one sync).
    """
    if len(x_shape) != 2:
        return f"x must be [T, H], got shape {tuple(x_shape)}"
    if x_device is not None and (topk_idx.device != x_device or topk_weights.device != x_device):
        return f"x, topk_idx, topk_weights must share a device, got {x_device}, {topk_idx.device}, {topk_weights.device}"
    if topk_idx.dtype != torch.int64:
        return f"topk_idx must be int64, got {topk_idx.dtype}"
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x_shape[0]:
        return f"topk_idx must be [T={x_shape[0]}, k], got shape {tuple(topk_idx.shape)}"
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        return f"topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape {tuple(topk_idx.shape)}"
    if check_range and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())  # device sync
        if lo < -1 or hi >= num_experts:
            return f"topk_idx has ids in [{lo}, {hi}]; allowed [0, {num_experts}) and -1 for none"
    return None


def compute_layout(topk_idx: torch.Tensor, placement: ExpertPlacement) -> Layout:
    """Resolve ``topk_idx`` [T, k] int64 (-1 = none, ids otherwise in [0, E)) to ranks and nodes.

    Inputs are assumed valid (see ``check_topk_idx``); ids >= E are clamped so that an invalid input
    reaches the verdict of the counts exchange instead of a device-side assert. Runs on topk_idx's
    device without a sync.
    """
    topo = placement.topology
    dev = topk_idx.device
    valid = topk_idx >= 0
    safe = topk_idx.clamp(0, placement.num_experts - 1)
    topk_rank = torch.where(valid, placement.expert_rank.to(dev)[safe], -1)
    topk_local = torch.where(valid, placement.expert_local_index.to(dev)[safe], -1)
    is_in_rank = rows_in_ranks(topk_rank, topo.world_size)
    is_in_node = is_in_rank.view(-1, topo.num_nodes, topo.ranks_per_node).any(-1)
    return Layout(
        topk_rank=topk_rank,
        topk_local=topk_local,
        is_token_in_rank=is_in_rank,
        is_token_in_node=is_in_node,
        tokens_per_rank=is_in_rank.sum(0),
        tokens_per_node=is_in_node.sum(0),
        tokens_per_expert=torch.zeros(placement.num_experts, dtype=torch.int64, device=dev).scatter_add_(
            0, safe.reshape(-1), valid.reshape(-1).long()
        ),  # not bincount: its CUDA kernel reads the input's maximum on the host
    )


def rows_in_ranks(topk_rank: torch.Tensor, num_ranks: int, first_rank: int = 0) -> torch.Tensor:
    """[Q, k] slot ranks (-1 = none) -> [Q, num_ranks] bool: row q has a slot on rank first_rank + i."""
    rel = topk_rank - first_rank
    inside = (topk_rank >= 0) & (rel >= 0) & (rel < num_ranks)
    out = torch.zeros(topk_rank.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_rank.device)
    out.scatter_(1, torch.where(inside, rel, num_ranks), True)  # column num_ranks collects "elsewhere"
    return out[:, :num_ranks]


def copies_per_rank(layout: Layout, num_ranks: int) -> torch.Tensor:
    """[R] int64: (token, slot) copies this rank sends to each rank under the flat all-to-all."""
    ranks = layout.topk_rank[layout.topk_rank >= 0]
    return torch.bincount(ranks, minlength=num_ranks)


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes and messages one rank sent, split by link class. Sends to itself are not counted."""

    intra_node_bytes: int = 0
    """Bytes sent to other ranks of the same node (NVLink on real hardware)."""
    inter_node_bytes: int = 0
    """Bytes sent to ranks on other nodes (RDMA / EFA / InfiniBand)."""
    intra_node_messages: int = 0
    """Non-empty point-to-point messages to other ranks of the same node."""
    inter_node_messages: int = 0
    """Non-empty point-to-point messages to ranks on other nodes."""

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.intra_node_bytes + other.intra_node_bytes,
            self.inter_node_bytes + other.inter_node_bytes,
            self.intra_node_messages + other.intra_node_messages,
            self.inter_node_messages + other.inter_node_messages,
        )

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.intra_node_bytes - other.intra_node_bytes,
            self.inter_node_bytes - other.inter_node_bytes,
            self.intra_node_messages - other.intra_node_messages,
            self.inter_node_messages - other.inter_node_messages,
        )

    def as_metrics(self, prefix: str = "ep/") -> dict[str, float]:
        """The four counters as a flat metrics record, e.g. ``{"ep/inter_node_bytes": ...}``."""
        return {f"{prefix}{name}": float(getattr(self, name)) for name in self.__slots__}


def send_traffic(
    topology: Topology, src_rank: int, dest_ranks: list[int], rows: list[int], row_bytes: int
) -> Traffic:
    """Traffic of sending ``rows[i]`` rows of ``row_bytes`` bytes from ``src_rank`` to ``dest_ranks[i]``."""
    intra = inter = intra_msgs = inter_msgs = 0
    for dest, count in zip(dest_ranks, rows, strict=True):
        if dest == src_rank or count == 0:
            continue
        if topology.is_same_node(src_rank, dest):
            intra, intra_msgs = intra + count * row_bytes, intra_msgs + 1
        else:
            inter, inter_msgs = inter + count * row_bytes, inter_msgs + 1
    return Traffic(intra, inter, intra_msgs, inter_msgs)
