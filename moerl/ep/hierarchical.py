"""Topology-aware hierarchical dispatcher: each token crosses the node boundary once per node.

Shape legend: T tokens on this rank, H hidden size, k top-k, R EP ranks, N nodes, G ranks per node,
L local experts per rank; P1/Q1 rows sent/received in stage 1, P2/Q2 in stage 2, M copies received.

The algorithm of DeepEP's normal-mode kernels (DeepSeek, 2025), on ``torch.distributed``:

1. cross-node stage: rank (n, g) sends each token once to every node it needs, to the rank with
   the same local index g there, together with its topk_idx and topk_weights rows;
2. intra-node stage: that rank forwards each received token once to every rank of its node that
   owns one of the token's experts;
3. the destination expands rows to (token, local expert) copies sorted by (local expert, source
   rank, source token).

Combine runs the reverse path: the destination sums the weighted outputs of a token's local experts,
the forwarding rank sums the partials of its node's ranks, and only that node-level partial crosses
the node boundary; the source sums the node partials. Every sum runs in a fixed order, in float32.

Autograd (``RowDispatchFn``, shared with the flat dispatcher, and this file's ``_HierCombineFn``):
backward(dispatch) runs the combine path on the copies' gradients (D^T g, unweighted) and brings the received weights' gradients back
to their [T, k] slots the same way; backward(combine) runs the dispatch path on the output gradient (D g,
stages 1 and 2 without metadata) and forms grad_y = w D g and the weights' gradient <D g, y> on the
expert's rank, which backward(dispatch) then carries home.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.ep.alltoall import AllToAllDispatcher, RowDispatchFn
from moerl.ep.collective import CollectiveDispatcher, RowHandle, needs_grad
from moerl.ep.comm import (
    GlobalCounts,
    accumulation_dtype,
    gather_slots,
    gather_sum,
    inverse_positions,
    pack_rows,
    unpack_rows,
)
from moerl.ep.layout import Layout, rows_in_ranks
from moerl.ep.rows import positions_of_true


@dataclass(frozen=True)
class HierarchicalPlan:
    """Index tensors and splits of one two-stage dispatch."""

    send1_token: torch.Tensor
    """[P1] int64 token of each stage-1 row, ordered by (destination node, token)."""
    pos0: torch.Tensor
    """[T, N] int64 stage-1 row of (token, node); P1 where the token does not need that node."""
    send1_splits: list[int]
    recv1_splits: list[int]
    send2_row: torch.Tensor
    """[P2] int64 stage-1 received row forwarded by each stage-2 row, ordered by (local rank, row)."""
    pos1: torch.Tensor
    """[Q1, G] int64 stage-2 row of (received row, local rank); P2 where not needed."""
    send2_splits: list[int]
    recv2_splits: list[int]
    copy_row: torch.Tensor
    """[M] int64 stage-2 received row of each expert-sorted copy."""
    pos2: torch.Tensor
    """[Q2, k] int64 copy index of (stage-2 row, slot); M where the slot's expert is not local."""
    tokens_per_local_expert: torch.Tensor
    """[L] int64."""


class HierarchicalDispatcher(CollectiveDispatcher):
    """Two-stage (cross-node, then intra-node) dispatch and the reverse combine; a ``moerl.ep.Dispatcher``.

    Args: as ``CollectiveDispatcher``: ``(topology, num_experts, group=None, *, placement="contiguous")``;
    builds the intra-node and cross-node subgroups (collective over ``group``).
    """

    def _build_links(self) -> None:
        """The cross-node (same local index) and intra-node links, over subgroups built here."""
        topology = self.topology
        groups = topology.build_groups(self.group)
        self._cross = self._link(groups.cross_node, topology.rail_ranks(groups.local_index))
        self._intra = self._link(groups.intra_node, topology.node_ranks(groups.node))
        self._flat = (
            AllToAllDispatcher(topology, self.num_experts, self.group, placement=self.placement)
            if topology.world_size == 1
            else None
        )
        """A group of one rank has nothing hierarchical to move: dispatch and combine take the flat
        dispatcher's single-rank path (same recv order, no traffic)."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, RowHandle]:
        """Send each token once to every node it needs, then to its experts' ranks there.

        Args and returns as ``AllToAllDispatcher.dispatch`` (the same recv_x, bitwise, in the same order).
        Raises:
            EPInputError: on every rank, when any rank's inputs are invalid (shape, dtype, ids out of
                range) or ranks disagree on H, k or dtype. Collective: every EP rank must call it.
        """
        if self._flat is not None:
            return self._flat.dispatch(x, topk_idx, topk_weights)
        layout, counts = self._route(x, topk_idx, topk_weights, single_rank_fast=False)
        start = self._traffic_now()
        if needs_grad(x, topk_weights):
            recv_x, recv_w, plan = RowDispatchFn.apply(x, topk_weights, topk_idx, layout, counts, self)
        else:  # nothing to differentiate: no autograd node (its bookkeeping is host time per call)
            recv_x, recv_w, plan = self._dispatch_rows(x, topk_idx, topk_weights, layout, counts)
        self._finish(start, "dispatch")
        return recv_x, RowHandle(plan, recv_w, plan.tokens_per_local_expert, x.shape[0], topk_weights)

    def combine(self, y: torch.Tensor, handle: RowHandle) -> torch.Tensor:
        """out[t] = sum_j w[t, j] * y[copy of (t, j)]: weighted on the expert's rank, reduced per node on
        the forwarding rank, summed over nodes at the source.

        Args:
            y: [M, H] expert outputs in recv_x's order (any float dtype; partials cross links in it).
            handle: from the matching ``dispatch``.
        Returns:
            [T, H] float32 (float64 for float64 y).
        Raises:
            ValueError: y has the wrong number of rows (local check: a caller bug, not a routing one).
        """
        if self._flat is not None:
            return self._flat.combine(y, handle)
        self._check_combine_input(y, handle)
        start = self._traffic_now()
        if needs_grad(y, handle.recv_weights):
            out = _HierCombineFn.apply(y, handle.recv_weights, handle.plan, self)
        else:  # nothing to differentiate: no autograd node
            out = self._reverse(y, handle.plan, y.dtype, weights=handle.recv_weights)
        self._finish(start, "combine")
        return out

    def _dispatch_rows(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: Layout,
        counts: GlobalCounts,
    ) -> tuple[torch.Tensor, torch.Tensor, HierarchicalPlan]:
        topo, me = self.topology, self.rank
        t, k = topk_idx.shape
        n_nodes, g_size = topo.num_nodes, topo.ranks_per_node
        node, li = topo.node_of(me), topo.local_index(me)
        # Stage 1: one row per (token, needed node), to the rank with my local index on that node.
        # Rows reach me from forwarder g' in the order of its sources (node m = 0..N-1, rank m*G + g').
        sources = [m * g_size + gf for gf in range(g_size) for m in range(n_nodes)]
        from_source = counts.tokens_per_rank[sources, me]
        # Host-to-device copies first, while the device is idle after the counts exchange's sync.
        src_rank = torch.repeat_interleave(torch.tensor(sources), from_source).to(x.device)  # [Q2]
        tokens_per_local_expert = counts.tokens_per_expert[:, self.local_experts].sum(0).to(x.device)
        # Split sizes from the exchanged counts (host side, no device read): stage 1 sends my tokens per
        # node; stage 2 forwards the rail sources' tokens to each rank of my node that needs them.
        send1_splits = counts.tokens_per_node[me].tolist()
        rail = topo.rail_ranks(li)
        recv1_splits = counts.tokens_per_node[rail, node].tolist()
        send2_splits = counts.tokens_per_rank[rail, node * g_size : (node + 1) * g_size].sum(0).tolist()
        node_pairs = positions_of_true(layout.is_token_in_node.T.reshape(-1), sum(send1_splits))
        node_tok = torch.stack(
            [node_pairs // max(t, 1), node_pairs % max(t, 1)], 1
        )  # (n, t) pairs by node, then token
        send1_token = node_tok[:, 1]
        wdt = accumulation_dtype(topk_weights.dtype)
        payload = pack_rows(x[send1_token], topk_idx[send1_token].int(), topk_weights[send1_token].to(wdt))
        rows1 = self._cross.exchange(payload, send1_splits, recv1_splits)
        (idx1,) = unpack_rows(rows1[:, x.shape[1] * x.element_size() :], [(torch.int32, (k,))])
        # Stage 2: forward each received row once to every rank of my node that owns one of its experts.
        rank1 = self._slot_ranks(idx1.long())
        in_local = rows_in_ranks(rank1, g_size, first_rank=node * g_size)  # [Q1, G]
        q1 = in_local.shape[0]
        local_pairs = positions_of_true(in_local.T.reshape(-1), sum(send2_splits))
        local_row = torch.stack([local_pairs // max(q1, 1), local_pairs % max(q1, 1)], 1)  # (g, q) pairs
        send2_row = local_row[:, 1]
        recv2_splits = from_source.view(g_size, n_nodes).sum(1).tolist()
        rows2 = self._intra.exchange(rows1[send2_row], send2_splits, recv2_splits)
        # x rows read in place from the packed rows (a strided view, gathered once below).
        x2 = rows2.view(x.dtype)[:, : x.shape[1]] if rows2.shape[1] % x.element_size() == 0 else None
        x2_copy, idx2, w2 = unpack_rows(rows2, [(x.dtype, (x.shape[1],)), (torch.int32, (k,)), (wdt, (k,))])
        x2 = x2_copy if x2 is None else x2
        num_copies = int(counts.tokens_per_expert[:, self.local_experts].sum())
        order, expanded = self._expand(idx2.long(), src_rank, k, num_copies)
        expanded["tokens_per_local_expert"] = tokens_per_local_expert
        plan = HierarchicalPlan(
            send1_token=send1_token,
            pos0=inverse_positions(node_tok[:, 1] * n_nodes + node_tok[:, 0], t, n_nodes),
            send1_splits=send1_splits,
            recv1_splits=recv1_splits,
            send2_row=send2_row,
            pos1=inverse_positions(local_row[:, 1] * g_size + local_row[:, 0], rows1.shape[0], g_size),
            send2_splits=send2_splits,
            recv2_splits=recv2_splits,
            **expanded,
        )
        return x2[plan.copy_row], w2.reshape(-1)[order], plan

    def _slot_ranks(self, idx: torch.Tensor) -> torch.Tensor:
        """[Q, k] expert ids (-1 = none) -> [Q, k] owning EP rank (-1 = none)."""
        ranks = self._on(idx.device)[0][idx.clamp(min=0)]
        return torch.where(idx >= 0, ranks, -1)

    def _expand(
        self, idx2: torch.Tensor, src_rank: torch.Tensor, k: int, num_copies: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Stage-2 rows [Q2, k] from source ranks ``src_rank`` [Q2] -> the M = ``num_copies`` (token, local
        expert) copies sorted by (local expert, source rank, source token). Returns the flat (row * k +
        slot) id of each copy [M] and the plan's copy fields."""
        r, q2 = self.topology.world_size, idx2.shape[0]
        mine = (self._slot_ranks(idx2) == self.rank).reshape(-1)
        local = self._on(idx2.device)[1][idx2.reshape(-1).clamp(min=0)]
        key = torch.where(mine, local * r + src_rank.repeat_interleave(k), self.placement.num_experts * r)
        order = torch.sort(key, stable=True).indices[:num_copies]  # (row, slot) order within a key
        return order, {"copy_row": order // k, "pos2": inverse_positions(order, q2, k)}

    def _forward(self, g: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
        """D: [T, C] -> [M, C] expert-sorted copies (same path as dispatch, without metadata)."""
        rows1 = self._cross.exchange(g[plan.send1_token], plan.send1_splits, plan.recv1_splits)
        rows2 = self._intra.exchange(rows1[plan.send2_row], plan.send2_splits, plan.recv2_splits)
        return rows2[plan.copy_row]

    def _reverse_rows(
        self, partial2: torch.Tensor, plan: HierarchicalPlan, wire_dtype: torch.dtype
    ) -> torch.Tensor:
        """Per stage-2 row partials [Q2, C] float32 -> per token [T, C] float32: reduced within the node
        on the forwarding rank, then across nodes on the source rank."""
        back2 = self._intra.exchange(partial2.to(wire_dtype), plan.recv2_splits, plan.send2_splits)
        partial1 = gather_sum(back2, plan.pos1)  # node-level partial: sum over the node's ranks
        back1 = self._cross.exchange(partial1.to(wire_dtype), plan.recv1_splits, plan.send1_splits)
        return gather_sum(back1, plan.pos0)

    def _reverse(
        self,
        z: torch.Tensor,
        plan: HierarchicalPlan,
        wire_dtype: torch.dtype,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """D^T (w * z): [M, C] -> [T, C] float32; the weights [M] (combine) are applied in the first
        gather-sum on the expert's rank (one pass over z, float32 accumulation)."""
        w = None if weights is None else gather_slots(weights, plan.pos2)
        return self._reverse_rows(gather_sum(z, plan.pos2, w), plan, wire_dtype)

    def _reverse_slots(self, g: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
        """[M] per-copy values -> [T, k] in g's dtype (slots are disjoint, so the sums are exact)."""
        return self._reverse_rows(gather_slots(g, plan.pos2), plan, g.dtype)


class _HierCombineFn(torch.autograd.Function):
    """out = D^T (w * y); backward: grad_y = w * D g, grad_w = <D g, y> per copy (on the expert's rank)."""

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
