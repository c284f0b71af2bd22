"""The dispatcher interface, its autograd, and the handle that carries a dispatch to its combine.

Shape legend: T tokens on this rank, H hidden size, k experts per token (top-k), E routed experts,
L local experts on this rank, M (token, local expert) copies received by this rank.

Both dispatch and combine are linear maps, so each is the other's adjoint (transpose):

    dispatch:  recv_x = D x                 (copy token t to each of its experts)
    combine:   out    = D^T (w * y)         (weight each copy, sum the copies of a token)

hence backward(dispatch)(g) = D^T g (an unweighted combine) and backward(combine)(g) = w * D g (a
dispatch). The router weights w travel with the tokens (``DispatchHandle.recv_weights``). Where the
dispatcher combines at the source (``_combine_at_source``: the flat all-to-all, whose every copy comes
back to its token's rank unreduced), combine sends the unweighted outputs back and weights them there
(out[t] = sum_j w[t, j] y[copy (t, j)], the weights of the sender's own ``topk_weights``), so the
weight gradient <g[t], y[copy]> is formed at the source too; otherwise (the hierarchical dispatcher,
which reduces on the way back) the received weights are applied on the expert's rank and their
gradient <D g, y> is sent back along the combine path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from moerl.ep.comm import (
    GlobalCounts,
    Link,
    SingleRankInputs,
    accumulation_dtype,
    exchange_counts,
)
from moerl.ep.layout import Layout, Traffic, check_topk_idx, compute_layout
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology


class Plan(Protocol):
    """A dispatcher's frozen routing plan (``AllToAllPlan``, ``HierarchicalPlan``): index tensors and
    split sizes computed once in dispatch and reused by combine and both backward passes."""

    tokens_per_local_expert: torch.Tensor


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs from the matching ``dispatch``: the routing plan and the received weights."""

    plan: Plan
    """Dispatcher-specific frozen plan (index tensors and split sizes); opaque to callers."""
    recv_weights: torch.Tensor
    """[M] float32 (float64 for float64 weights): router weight of each received copy, in recv_x's
    order; differentiable (its gradient flows back to ``topk_weights``)."""
    tokens_per_local_expert: torch.Tensor
    """[L] int64 received copies per local expert (sums to M)."""
    num_tokens: int
    """T, tokens this rank dispatched (rows of combine's output)."""
    topk_weights: torch.Tensor | None = None
    """[T, k] the sender's router weights as given to ``dispatch`` (differentiable); combine weights
    with them where the dispatcher combines at the source."""


class Dispatcher:
    """Base of the EP dispatchers: validation, counts exchange, autograd and traffic accounting.

    Subclasses implement the data movement: ``_dispatch_rows`` (forward, with routing metadata),
    ``_forward`` (D: tokens -> expert-sorted copies), ``_reverse`` (D^T: copies -> per-token float32
    sums) and ``_reverse_slots`` (per-copy scalars back to their [T, k] slots), and opens its links in
    ``_build_links``; a subclass that sets ``_combine_at_source`` also implements ``_source_combine``
    and ``_source_combine_backward``.

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

    _combine_at_source = False
    """Whether combine weights at the source (see the module docstring)."""
    _single_rank_fast = False
    """Whether ``_dispatch_rows`` takes a ``SingleRankInputs`` in a group of one rank (no layout, no table)."""

    # ------------------------------------------------------------------ public API

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the EP ranks of its experts.

        Args:
            x: [T, H] float32/bfloat16/float16 tokens (T may be 0; H and dtype equal on all ranks).
            topk_idx: [T, k] int64 expert ids in [0, E), -1 = empty slot.
            topk_weights: [T, k] float router weights (gradients flow to them through combine).
        Returns:
            recv_x [M, H] in x's dtype, sorted by local expert, then source rank, then source token
            (in a group of one rank during a CUDA graph capture: [T k, H], the M copies first and the
            rest never read by ``combine``; ids are then not range-checked); tokens_per_local_expert [L]
            int64; the handle for ``combine``.
        Raises:
            EPInputError: on every rank, when any rank's inputs are invalid (shape, dtype, ids out of
                range) or ranks disagree on H, k or dtype. Collective: every EP rank must call it.
        """
        problem = check_topk_idx(
            tuple(x.shape), topk_idx, topk_weights, self.num_experts, x.device, check_range=False
        )
        k = topk_idx.shape[-1] if topk_idx.dim() else 0
        if self.topology.world_size == 1 and self._single_rank_fast:
            # A group of one rank: no layout, no counts table; the plan is one sync-free counting sort and
            # the one device read (ids' range, copy count) comes after the payload gather is queued.
            inputs = SingleRankInputs(problem, tuple(x.shape), k, (x.dtype, topk_weights.dtype))
            if _needs_grad(x, topk_weights):
                recv_x, recv_w, plan = _DispatchFn.apply(x, topk_weights, topk_idx, None, inputs, self)
            else:  # nothing to differentiate: no autograd node (its bookkeeping is host time per call)
                recv_x, recv_w, plan = self._dispatch_rows(x, topk_idx, topk_weights, None, inputs)
            return recv_x, plan.tokens_per_local_expert, self._handle(plan, recv_w, x, topk_weights)
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
            (x.dtype, topk_weights.dtype),
            local,
            self.num_experts,
            self.topology,
            self.group,
            x.device,
            topk_idx=topk_idx if problem is None else None,
        )  # the dispatch's one device sync (ids checked there too); combine and backward have none
        start = self._traffic_now()
        if _needs_grad(x, topk_weights):
            recv_x, recv_w, plan = _DispatchFn.apply(x, topk_weights, topk_idx, layout, counts, self)
        else:
            recv_x, recv_w, plan = self._dispatch_rows(x, topk_idx, topk_weights, layout, counts)
        self._finish(start, "dispatch")
        return recv_x, plan.tokens_per_local_expert, self._handle(plan, recv_w, x, topk_weights)

    def _handle(
        self, plan: Plan, recv_w: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchHandle:
        return DispatchHandle(
            plan=plan,
            recv_weights=recv_w,
            num_tokens=x.shape[0],
            tokens_per_local_expert=plan.tokens_per_local_expert,
            topk_weights=topk_weights,
        )

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return expert outputs to their tokens: out[t] = sum_j w[t, j] * y[copy of (t, j)].

        Args:
            y: [M, H] expert outputs in recv_x's order (any float dtype; sent in this dtype).
            handle: from the matching ``dispatch``.
        Returns:
            [T, H] float32 (float64 for float64 y): sums accumulated in float32, partial sums cross
            links in y's dtype.
        Raises:
            ValueError: y has the wrong number of rows (local check: a caller bug, not a routing one).
        """
        m = handle.recv_weights.shape[0]
        if y.dim() != 2 or y.shape[0] != m:
            raise ValueError(f"combine: y must be [M={m}, H], got shape {tuple(y.shape)}")
        counted = self.topology.world_size > 1  # a group of one rank sends nothing: its Traffic stays 0
        start = self._traffic_now() if counted else None
        if self._combine_at_source and handle.topk_weights is not None:
            w = handle.topk_weights
            if _needs_grad(y, w):
                out = _SourceCombineFn.apply(y, w, handle.plan, self)
            else:  # nothing to differentiate: no autograd node
                out = self._source_combine(y, w, handle.plan)[0]
        elif _needs_grad(y, handle.recv_weights):
            out = _CombineFn.apply(y, handle.recv_weights, handle.plan, self)
        else:
            out = self._reverse(y, handle.plan, y.dtype, weights=handle.recv_weights)
        if counted:
            self._finish(start, "combine")
        return out

    def _on(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The placement's expert_rank [E], expert_local_index [E] and this rank's local_experts [L] on
        ``dev``, copied once per device (a host-to-device copy per call would wait for the device)."""
        if dev not in self._placement_cache:
            p = self.placement
            self._placement_cache[dev] = tuple(
                t.to(dev) for t in (p.expert_rank, p.expert_local_index, self.local_experts)
            )
        return self._placement_cache[dev]

    # ------------------------------------------------------------------ subclass hooks

    def _dispatch_rows(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: Layout,
        counts: GlobalCounts,
    ) -> tuple[torch.Tensor, torch.Tensor, Plan]:
        raise NotImplementedError

    def _forward(self, g: torch.Tensor, plan: Plan) -> torch.Tensor:
        raise NotImplementedError

    def _reverse(
        self, z: torch.Tensor, plan: Plan, wire_dtype: torch.dtype, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """D^T (w * z): [M, C] copies (any float dtype) -> [T, C] float32 sums; w [M] per copy or None = 1."""
        raise NotImplementedError

    def _reverse_slots(self, g: torch.Tensor, plan: Plan) -> torch.Tensor:
        raise NotImplementedError

    def _source_combine(
        self, y: torch.Tensor, w: torch.Tensor, plan: Plan
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """out [T, C] float32 = sum_j w[t, j] y[copy (t, j)] and the tensors its backward needs."""
        raise NotImplementedError

    def _source_combine_backward(
        self, g: torch.Tensor, w: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_y [M, C] in y's dtype, grad_w [T, k]) of ``_source_combine`` for the output gradient g."""
        raise NotImplementedError

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
        self._count(start, direction)
        self.last_traffic = self.total_traffic - start

    def _count(self, start: Traffic, direction: str) -> None:
        """Add what the links sent since ``start`` to ``direction`` and bring ``total_traffic`` up to date."""
        now = self._traffic_now()
        self.traffic_by_direction[direction] = self.traffic_by_direction[direction] + (now - start)
        self.total_traffic = now


def _needs_grad(*ts: torch.Tensor) -> bool:
    """Whether autograd would record an op on these inputs (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


class _DispatchFn(torch.autograd.Function):
    """recv_x = D x and recv_w = D_w w; backward: D^T g_x (unweighted combine) and D_w^T g_w."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, layout, counts, disp):  # noqa: D102
        with torch.no_grad():
            recv_x, recv_w, plan = disp._dispatch_rows(x, topk_idx, topk_weights, layout, counts)
        ctx.disp, ctx.plan, ctx.x_dtype, ctx.w_dtype = disp, plan, x.dtype, topk_weights.dtype
        return recv_x, recv_w, plan

    @staticmethod
    def backward(ctx, g_x, g_w, _):  # noqa: D102
        # Both collectives run on every rank whatever needs_input_grad says, so ranks stay in step.
        start = ctx.disp._traffic_now()
        grad_x = ctx.disp._reverse(g_x, ctx.plan, ctx.x_dtype).to(ctx.x_dtype)
        grad_w = ctx.disp._reverse_slots(g_w.to(accumulation_dtype(ctx.w_dtype)), ctx.plan).to(ctx.w_dtype)
        ctx.disp._count(start, "combine")  # gradients go back to the tokens' ranks
        return grad_x, grad_w, None, None, None, None


class _CombineFn(torch.autograd.Function):
    """out = D^T (w * y); backward: grad_y = w * D g, grad_w = <D g, y> per copy."""

    @staticmethod
    def forward(ctx, y, recv_w, plan, disp):  # noqa: D102
        ctx.save_for_backward(y, recv_w)
        ctx.disp, ctx.plan = disp, plan
        with torch.no_grad():
            return disp._reverse(y, plan, y.dtype, weights=recv_w)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        y, recv_w = ctx.saved_tensors
        acc = accumulation_dtype(y.dtype)
        start = ctx.disp._traffic_now()
        gy = ctx.disp._forward(g.to(y.dtype), ctx.plan).to(acc)
        ctx.disp._count(start, "dispatch")  # gradients go out to the experts' ranks
        grad_y = (recv_w.to(acc)[:, None] * gy).to(y.dtype)
        grad_w = (gy * y.to(acc)).sum(-1).to(recv_w.dtype)
        return grad_y, grad_w, None, None


class _SourceCombineFn(torch.autograd.Function):
    """out[t] = sum_j w[t, j] y[copy (t, j)], weighted at the source; backward: grad_y = D (w g) and
    grad_w[t, j] = <g[t], y[copy (t, j)]>, both formed at the source."""

    @staticmethod
    def forward(ctx, y, topk_weights, plan, disp):  # noqa: D102
        with torch.no_grad():
            out, saved = disp._source_combine(y, topk_weights, plan)
        ctx.disp, ctx.plan, ctx.saved = disp, plan, saved
        ctx.save_for_backward(topk_weights)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        (w,) = ctx.saved_tensors
        start = ctx.disp._traffic_now()
        grad_y, grad_w = ctx.disp._source_combine_backward(g, w, ctx.saved, ctx.plan)
        ctx.disp._count(start, "dispatch")  # gradients go out to the experts' ranks
        return grad_y, grad_w, None, None
