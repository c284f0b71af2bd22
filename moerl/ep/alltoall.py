"""Flat all-to-all token dispatcher: the standard EP baseline (as Megatron-LM's all-to-all dispatcher).

Shape legend: T tokens on this rank, H hidden size, k top-k, R EP ranks, L local experts per rank,
P (token, slot) copies sent by this rank, M copies received.

Dispatch sends one copy per (token, expert) slot straight to the expert's rank with one
``all_to_all_single`` over the EP group; the split sizes come from the counts exchanged first. A
token whose k experts sit on 3 ranks of another node crosses the node boundary k times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.ep.comm import (
    GlobalCounts,
    accumulation_dtype,
    gather_slots,
    gather_sum,
    inverse_positions,
    pack_rows,
    unpack_rows,
)
from moerl.ep.dispatcher import Dispatcher
from moerl.ep.layout import Layout, copies_per_rank
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology


@dataclass(frozen=True)
class AllToAllPlan:
    """Index tensors and splits of one flat all-to-all dispatch."""

    send_token: torch.Tensor
    """[P] int64 source token of each sent copy, ordered by (destination rank, local expert, token, slot)."""
    slot_pos: torch.Tensor
    """[T, k] int64 position of slot (t, j) among the P sent copies; P for empty slots."""
    send_splits: list[int]
    """[R] copies sent to each rank."""
    recv_splits: list[int]
    """[R] copies received from each rank."""
    recv_perm: torch.Tensor
    """[M] received-buffer row of each expert-sorted output row."""
    tokens_per_local_expert: torch.Tensor
    """[L] int64."""


class AllToAllDispatcher(Dispatcher):
    """One copy per (token, expert) through one ``all_to_all_single`` (see ``Dispatcher`` for the API).

    Args: as ``Dispatcher``: ``(topology, num_experts, group=None, *, placement="contiguous")``.
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        placement: str | ExpertPlacement = "contiguous",
    ) -> None:
        super().__init__(topology, num_experts, group, placement=placement)
        self._all = self._link(self.group, list(range(topology.world_size)))

    def _dispatch_rows(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: Layout,
        counts: GlobalCounts,
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllPlan]:
        t, k = topk_idx.shape
        r, num_local = self.topology.world_size, self.placement.num_local_experts
        dev = x.device
        # Sender side: valid (token, slot) pairs ordered by (destination rank, local expert, token, slot).
        flat_valid = torch.nonzero(topk_idx.reshape(-1) >= 0).flatten()
        key = (layout.topk_rank * num_local + layout.topk_local).reshape(-1)[flat_valid]
        order = flat_valid[key.argsort(stable=True)]
        send_token = order // k
        # Receiver side: counts[s, l] copies from source s for local expert l; buffer rows arrive by
        # (source, local expert, token); a stable sort by local expert gives (expert, source, token).
        c = counts.tokens_per_expert[:, self.local_experts]  # [R, L]
        expert_of_row = torch.arange(num_local).repeat(r).repeat_interleave(c.flatten())
        plan = AllToAllPlan(
            send_token=send_token,
            slot_pos=inverse_positions(order, t, k),
            send_splits=copies_per_rank(layout, r).tolist(),  # device sync: split sizes
            recv_splits=c.sum(1).tolist(),
            recv_perm=expert_of_row.argsort(stable=True).to(dev),
            tokens_per_local_expert=c.sum(0).to(dev),
        )
        wdt = accumulation_dtype(topk_weights.dtype)
        payload = pack_rows(x[send_token], topk_weights.reshape(-1)[order].to(wdt))
        recv = self._all.exchange(payload, plan.send_splits, plan.recv_splits)
        rx, rw = unpack_rows(recv, [(x.dtype, (x.shape[1],)), (wdt, ())])
        return rx[plan.recv_perm], rw[plan.recv_perm], plan

    def _forward(self, g: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """D: [T, C] -> [M, C] expert-sorted copies."""
        return self._all.exchange(g[plan.send_token], plan.send_splits, plan.recv_splits)[plan.recv_perm]

    def _send_back(self, z: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """Expert-sorted [M, ...] rows back to their senders -> [P, ...] in send order."""
        buf = torch.empty_like(z)
        buf[plan.recv_perm] = z
        return self._all.exchange(buf, plan.recv_splits, plan.send_splits)

    def _reverse(self, z: torch.Tensor, plan: AllToAllPlan, wire_dtype: torch.dtype) -> torch.Tensor:
        """D^T: [M, C] float32 (float64) -> [T, C] float32 (float64), each token's copies summed in slot order."""
        return gather_sum(self._send_back(z.to(wire_dtype), plan), plan.slot_pos)

    def _reverse_slots(self, g: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """[M] per-copy values -> [T, k] at their slots (0 for empty slots), in g's dtype."""
        return gather_slots(self._send_back(g, plan), plan.slot_pos)
