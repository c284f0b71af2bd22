"""Expert placement (which EP rank owns each routed expert) and node-limited routing.

Shape legend: T tokens, k experts per token (top-k), E routed experts, R EP ranks, G ranks per node,
N nodes, L = E / R local experts per rank, M = max nodes per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moerl.ep.topology import Topology

PLACEMENTS = ("contiguous", "round_robin")


@dataclass(frozen=True)
class ExpertPlacement:
    """Map of E routed experts onto R EP ranks, L = E / R each.

    ``contiguous`` (default): rank r owns experts [r*L, (r+1)*L), so a node owns a contiguous block
    of E / N experts and node-limited routing (DeepSeek-V3) can treat nodes as expert groups.
    ``round_robin``: expert e lives on rank e % R as local expert e // R.

    Raises:
        ValueError: E < 1, E not a multiple of R, or an unknown ``kind``.
    """

    num_experts: int
    topology: Topology
    kind: str = "contiguous"
    expert_rank: torch.Tensor = field(init=False, repr=False)
    """[E] int64: EP rank owning each expert."""
    expert_local_index: torch.Tensor = field(init=False, repr=False)
    """[E] int64: index of each expert among its rank's local experts."""

    def __post_init__(self) -> None:
        e, r = self.num_experts, self.topology.world_size
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown expert placement {self.kind!r}; choose one of {PLACEMENTS}")
        if e < 1 or e % r:
            raise ValueError(f"num_experts={e} must be a positive multiple of the EP world size {r}")
        ids = torch.arange(e)
        if self.kind == "contiguous":
            rank, local = ids // (e // r), ids % (e // r)
        else:
            rank, local = ids % r, ids // r
        object.__setattr__(self, "expert_rank", rank)
        object.__setattr__(self, "expert_local_index", local)

    @property
    def num_local_experts(self) -> int:
        """L = E / R."""
        return self.num_experts // self.topology.world_size

    @property
    def expert_node(self) -> torch.Tensor:
        """[E] int64: node of each expert."""
        return self.expert_rank // self.topology.ranks_per_node

    def local_experts(self, rank: int) -> torch.Tensor:
        """[L] int64 global ids of rank ``rank``'s experts, in local-index order."""
        ids = torch.nonzero(self.expert_rank == rank).flatten()
        return ids[self.expert_local_index[ids].argsort()]


def node_limited_topk(
    scores: torch.Tensor, top_k: int, max_nodes: int, placement: ExpertPlacement
) -> torch.Tensor:
    """Node-limited top-k routing (DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2 "Node-Limited Routing").

    Each token may use experts on at most ``max_nodes`` = M nodes: nodes are ranked by the sum of
    the token's ``top_k / M`` highest affinity scores among that node's experts, the best M kept,
    and the top-k experts are chosen among the kept nodes' experts.

    Args:
        scores: [T, E] float affinity scores (higher = preferred).
        top_k: k, experts per token; k <= M * E / N.
        max_nodes: M, 1 <= M <= N.
        placement: the expert placement that defines each expert's node.
    Returns:
        [T, k] int64 expert ids, every token's ids on at most M nodes.
    Raises:
        ValueError: bad shapes or a k/M combination that cannot be met.
    """
    t, e = scores.shape
    n = placement.topology.num_nodes
    per_node = e // n
    if e != placement.num_experts:
        raise ValueError(f"scores has {e} experts but the placement has {placement.num_experts}")
    if not 1 <= max_nodes <= n or not 1 <= top_k <= max_nodes * per_node:
        raise ValueError(
            f"need 1 <= max_nodes={max_nodes} <= {n} nodes and 1 <= top_k={top_k} <= {max_nodes * per_node}"
        )
    node = placement.expert_node.to(scores.device)
    by_node = scores[:, node.argsort(stable=True)].view(t, n, per_node)  # experts grouped by node
    best = max(1, top_k // max_nodes)
    node_score = by_node.topk(min(best, per_node), dim=-1).values.sum(-1)  # (T, N)
    keep = torch.zeros(t, n, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, node_score.topk(max_nodes, dim=-1).indices, True)
    masked = scores.masked_fill(~keep[:, node], float("-inf"))
    return masked.topk(top_k, dim=-1).indices


def sample_node_limited_routing(
    num_tokens: int,
    top_k: int,
    max_nodes: int,
    placement: ExpertPlacement,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw routing uniformly under the node limit: M distinct nodes uniformly at random per token,
    then k distinct experts uniformly among those nodes' experts.

    Returns:
        [T, k] int64 expert ids.
    Raises:
        ValueError: as ``node_limited_topk``.
    """
    n = placement.topology.num_nodes
    e = placement.num_experts
    if not 1 <= max_nodes <= n or not 1 <= top_k <= max_nodes * (e // n):
        raise ValueError(
            f"need 1 <= max_nodes={max_nodes} <= {n} and 1 <= top_k={top_k} <= {max_nodes * (e // n)}"
        )
    node_pick = torch.rand(num_tokens, n, generator=generator).topk(max_nodes, dim=-1).indices
    keep = torch.zeros(num_tokens, n, dtype=torch.bool).scatter_(1, node_pick, True)
    scores = torch.rand(num_tokens, e, generator=generator).masked_fill(~keep[:, placement.expert_node], -1.0)
    return scores.topk(top_k, dim=-1).indices
