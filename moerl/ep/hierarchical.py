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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.ep.alltoall import AllToAllDispatcher
from moerl.ep.comm import (
    GlobalCounts,
    accumulation_dtype,
    gather_slots,
    gather_sum,
    inverse_positions,
    pack_rows,
    unpack_rows,
)
from moerl.ep.dispatcher import Dispatcher, DispatchHandle
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


class HierarchicalDispatcher(Dispatcher):
    """Two-stage (cross-node, then intra-node) dispatch and the reverse combine; API of ``Dispatcher``.

    Args: as ``Dispatcher``: ``(topology, num_experts, group=None, *, placement="contiguous")``; builds
    the intra-node and cross-node subgroups (collective over ``group``).
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
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """See ``Dispatcher.dispatch``."""
        if self._flat is not None:
            return self._flat.dispatch(x, topk_idx, topk_weights)
        return super().dispatch(x, topk_idx, topk_weights)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``."""
        if self._flat is not None:
            return self._flat.combine(y, handle)
        return super().combine(y, handle)

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
