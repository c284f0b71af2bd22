"""What the dispatchers built on ``torch.distributed`` collectives share: the EP group and expert placement,
the agreed input checks and counts exchange that start every dispatch, byte accounting per link, and the
handle they pass from dispatch to combine. No autograd: each dispatcher owns its own (``alltoall.py``,
``hierarchical.py``); a backend with its own buffers (DeepEP) implements ``moerl.ep.dispatcher.Dispatcher``
directly and may use this base only for the bookkeeping.

Shape legend: T tokens on this rank, H hidden size, k experts per token (top-k), E routed experts,
L local experts on this rank, M (token, local expert) copies received by this rank, R EP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from moerl.ep.comm import GlobalCounts, Link, SingleRankInputs, exchange_counts
from moerl.ep.layout import Layout, Traffic, check_topk_idx, compute_layout
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology


class Plan(Protocol):
    """A dispatcher's frozen routing plan (``AllToAllPlan``, ``HierarchicalPlan``): index tensors and
    split sizes computed once in dispatch and reused by combine and both backward passes."""

    tokens_per_local_expert: torch.Tensor


@dataclass(frozen=True)
class RowHandle:
    """The ``DispatchHandle`` of the collective dispatchers: the routing plan and the received weights."""

    plan: Plan
    """Dispatcher-specific frozen plan (index tensors and split sizes); opaque to callers."""
    recv_weights: torch.Tensor
    """[M] float32 (float64 for float64 weights): router weight of each received copy, in recv_x's
    order; differentiable (its gradient flows back to ``topk_weights``)."""
    tokens_per_local_expert: torch.Tensor
    """[L] int64 received copies per local expert (sums to M)."""
    num_tokens: int
    """T, tokens this rank dispatched (rows of combine's output)."""
    topk_weights: torch.Tensor
    """[T, k] the sender's router weights as given to ``dispatch`` (differentiable); the flat dispatcher's
    combine weights with them at the source."""


class CollectiveDispatcher:
    """Base of the dispatchers built on ``torch.distributed``: group, placement, checks, traffic counters.

    Subclasses implement ``dispatch`` and ``combine`` (and their autograd) and open their links in
    ``_build_links``.

    Args:
        topology: the EP ranks' node layout; its world size must equal the size of ``group``.
        num_experts: E routed experts per MoE layer, a multiple of the EP world size.
        group: the EP process group (None = default group). Collective: every member constructs the
            dispatcher in the same order.
        placement: ``"contiguous"`` or ``"round_robin"`` (see ``ExpertPlacement``), or a placement.
    Raises:
        ValueError: group size != topology.world_size, or a bad placement.
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        placement: str | ExpertPlacement = "contiguous",
    ) -> None:
        self.topology = topology
        self.group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(self.group)
        if size != topology.world_size:
            raise ValueError(
                f"Topology.world_size={topology.world_size} but the EP process group has {size} ranks"
            )
        self.rank = dist.get_rank(self.group)
        self.placement = (
            placement
            if isinstance(placement, ExpertPlacement)
            else ExpertPlacement(num_experts, topology, placement)
        )
        if self.placement.num_experts != num_experts or self.placement.topology != topology:
            raise ValueError("placement does not match num_experts / topology")
        self.num_experts = num_experts
        self.local_experts = self.placement.local_experts(self.rank)
        """[L] int64 global ids of this rank's experts, in local order."""
        self.last_traffic = Traffic()
        """Traffic this rank sent in the last ``dispatch`` or ``combine`` call (forward only)."""
        self.total_traffic = Traffic()
        """Traffic this rank sent since construction, backward passes included."""
        self.traffic_by_direction = {"dispatch": Traffic(), "combine": Traffic()}
        """``total_traffic`` split by the direction the data moved: ``dispatch`` towards the experts' ranks
        (dispatch forward, combine backward), ``combine`` back to the tokens' ranks (combine forward,
        dispatch backward); the two always sum to ``total_traffic``."""
        self._links: list[Link] = []
        self._placement_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._build_links()

    def _build_links(self) -> None:
        """Open the subclass's communication links with ``_link`` (called last by ``__init__``, so every
        field above is set; collective over ``group`` where a subclass builds subgroups)."""

    # ------------------------------------------------------------------ dispatch's front half

    def _route(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, single_rank_fast: bool
    ) -> tuple[Layout | None, GlobalCounts | SingleRankInputs]:
        """Check the inputs and agree on the counts: the start of every dispatch (collective).

        Returns (layout, counts): this rank's ``Layout`` (None in a group of one rank on the fast path) and
        every rank's ``GlobalCounts``, or the host-side ``SingleRankInputs`` on the fast path. With ``single_rank_fast`` in a group of one rank nothing is computed on the device: the host
        checks are deferred to the dispatcher's single-rank path (``SingleRankInputs``). Otherwise the
        local layout is computed and every rank's counts are all-gathered (``exchange_counts``: the
        dispatch's one device sync, the ids' range checked there too).

        Raises:
            EPInputError: on every rank, when any rank's inputs are invalid (see ``exchange_counts``).
        """
        problem = check_topk_idx(
            tuple(x.shape), topk_idx, topk_weights, self.num_experts, x.device, check_range=False
        )
        k = topk_idx.shape[-1] if topk_idx.dim() else 0
        dtypes = (x.dtype, topk_weights.dtype)
        if single_rank_fast and self.topology.world_size == 1:
            return None, SingleRankInputs(problem, tuple(x.shape), k, dtypes)
        layout = None if problem is not None else compute_layout(topk_idx, self.placement)
        local = (
            None
            if layout is None
            else (layout.tokens_per_expert, layout.tokens_per_rank, layout.tokens_per_node)
        )
        counts = exchange_counts(
            problem,
            tuple(x.shape),
            k,
            dtypes,
            local,
            self.num_experts,
            self.topology,
            self.group,
            x.device,
            topk_idx=topk_idx if problem is None else None,
        )  # the dispatch's one device sync (ids checked there too); combine and backward have none
        return layout, counts

    @staticmethod
    def _check_combine_input(y: torch.Tensor, handle: RowHandle) -> None:
        """Raise ``ValueError`` unless y is [M, H] for the handle's M (a caller bug, not a routing one)."""
        m = handle.recv_weights.shape[0]
        if y.dim() != 2 or y.shape[0] != m:
            raise ValueError(f"combine: y must be [M={m}, H], got shape {tuple(y.shape)}")

    def _on(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The placement's expert_rank [E], expert_local_index [E] and this rank's local_experts [L] on
        ``dev``, copied once per device (a host-to-device copy per call would wait for the device)."""
        if dev not in self._placement_cache:
            p = self.placement
            self._placement_cache[dev] = tuple(
                t.to(dev) for t in (p.expert_rank, p.expert_local_index, self.local_experts)
            )
        return self._placement_cache[dev]

    # ------------------------------------------------------------------ traffic

    def _link(self, group: dist.ProcessGroup, ep_ranks: list[int]) -> Link:
        link = Link(group, ep_ranks, self.rank, self.topology)
        self._links.append(link)
        return link

    def _traffic_now(self) -> Traffic:
        total = Traffic()
        for link in self._links:
            total = total + link.traffic
        return total

    def _finish(self, start: Traffic, direction: str) -> None:
        """End a forward ``dispatch`` or ``combine``: count what it sent and set ``last_traffic``."""
        self._count(start, direction)
        self.last_traffic = self.total_traffic - start

    def _count(self, start: Traffic, direction: str) -> None:
        """Add what the links sent since ``start`` to ``direction`` and bring ``total_traffic`` up to date."""
        now = self._traffic_now()
        self.traffic_by_direction[direction] = self.traffic_by_direction[direction] + (now - start)
        self.total_traffic = now


def needs_grad(*ts: torch.Tensor) -> bool:
    """Whether autograd would record an op on these inputs (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)
