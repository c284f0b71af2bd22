"""Flat all-to-all token dispatcher: the standard EP baseline (as Megatron-LM's all-to-all dispatcher).

Shape legend: T tokens on this rank, H hidden size, k top-k, R EP ranks, L local experts per rank,
P (token, slot) copies this rank routes (P_o of them to other ranks), M copies it receives (Q_o of
them from other ranks).

Dispatch sends one copy per (token, expert) slot straight to the expert's rank with one
``all_to_all_single`` over the EP group; the split sizes come from the counts exchanged first (the
dispatch's one device sync; combine and both backward passes reuse them). A token whose k experts sit
on 3 ranks of another node crosses the node boundary k times.

Row movement (``moerl.ep.rows``): the copies a rank keeps never go through the collective. The
expert-sorted output is gathered in one pass from the rank's own tokens and the receive buffer;
combine sends the unweighted expert outputs of other ranks' copies back, and each source sums its
tokens' k rows from its own outputs and the returned rows in one weighted pass (float32 accumulation,
its own ``topk_weights``). With ``fp8_dispatch`` the forward payload is float8 (e4m3) with one float32
scale per token, dequantized to x's dtype by the gathering pass.

Autograd (this file's own, ``RowDispatchFn`` and ``_FlatCombineFn``): backward(dispatch) sends the
copies' gradients back and sums them per token (D^T g, unweighted; the received weights' gradient rides
along to their [T, k] slots); backward(combine) sends w g out to the copies (D (w g)) and forms the
router-weight gradient <g[t], y[copy (t, j)]> at the source, from the rows combine already brought back.
A group of one rank takes a sync-free counting sort instead of the exchange (``_dispatch_single_rank``),
with the same autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.ep.collective import CollectiveDispatcher, RowHandle, needs_grad
from moerl.ep.comm import GlobalCounts, PinnedRead, SingleRankInputs, accumulation_dtype, check_single_rank
from moerl.ep.layout import Layout
from moerl.ep.placement import ExpertPlacement
from moerl.ep.rows import (
    gather_rows2,
    gather_slots2,
    gather_sum2,
    gather_sum2_backward,
    quantize_rows_fp8,
    single_rank_layout,
)
from moerl.ep.topology import Topology


@dataclass(frozen=True)
class AllToAllPlan:
    """Index tensors and splits of one flat all-to-all dispatch. "Sources" index cat([local, received]):
    a value below the local row count names a local row, the rest a row of the collective's buffer."""

    send_token: torch.Tensor
    """[P_o] int64 source token of each copy sent to another rank, ordered by (rank, local expert, token, slot)."""
    send_slot: torch.Tensor
    """[P_o] int64 flat slot (t * k + j) of each sent copy."""
    send_splits: list[int]
    """[R] copies sent to each rank through the collective (0 for this rank)."""
    recv_splits: list[int]
    """[R] copies received from each rank through the collective (0 for this rank)."""
    src_row: torch.Tensor
    """[M] int64 row of cat([x [T], received [Q_o]]) of each expert-sorted output row."""
    src_slot: torch.Tensor
    """[M] int64 row of cat([flat slots [T k], received [Q_o]]) of each output row (its weight)."""
    recv_out_row: torch.Tensor
    """[Q_o] int64 output row of each row received through the collective."""
    slot_src: torch.Tensor
    """[T, k] int64 row of cat([outputs [M], returned rows [P_o]]) holding slot (t, j)'s copy; -1 if empty."""
    tokens_per_local_expert: torch.Tensor
    """[L] int64."""


def _excl_cumsum(c: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return c.cumsum(dim) - c


class AllToAllDispatcher(CollectiveDispatcher):
    """One copy per (token, expert) through one ``all_to_all_single``; a ``moerl.ep.Dispatcher``.

    Args: as ``CollectiveDispatcher``: ``(topology, num_experts, group=None, *, placement="contiguous")``, and
        fp8_dispatch: send the forward payload as float8_e4m3fn with a float32 scale per token
            (``moerl.ep.rows.quantize_rows_fp8``); recv_x is dequantized to x's dtype. Every copy is
            quantized, local ones too, so the result does not depend on the placement. Relative error
            of recv_x about 3e-2 (e4m3 has 3 mantissa bits); backward passes stay in x's dtype
            (straight-through: the quantization's gradient is taken as the identity).
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        placement: str | ExpertPlacement = "contiguous",
        fp8_dispatch: bool = False,
    ) -> None:
        super().__init__(topology, num_experts, group, placement=placement)
        self.fp8_dispatch = fp8_dispatch
        self._read = PinnedRead()

    def _build_links(self) -> None:
        """One link over the whole EP group."""
        self._all = self._link(self.group, list(range(self.topology.world_size)))

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, RowHandle]:
        """Send each token to the EP ranks of its experts (``moerl.ep.Dispatcher.dispatch``).

        Args:
            x: [T, H] float32/bfloat16/float16 tokens (T may be 0; H and dtype equal on all ranks).
            topk_idx: [T, k] int64 expert ids in [0, E), -1 = empty slot.
            topk_weights: [T, k] float router weights (gradients flow to them through combine).
        Returns:
            recv_x [M, H] in x's dtype, sorted by local expert, then source rank, then source token (in a
            group of one rank during a CUDA graph capture: [T k, H], the M copies first and the rest never
            read by ``combine``; ids are then not range-checked), and the handle for ``combine``
            (``tokens_per_local_expert`` [L] int64, ``recv_weights`` [M] float32).
        Raises:
            EPInputError: on every rank, when any rank's inputs are invalid (shape, dtype, ids out of
                range) or ranks disagree on H, k or dtype. Collective: every EP rank must call it.
        """
        layout, counts = self._route(x, topk_idx, topk_weights, single_rank_fast=True)
        counted = not isinstance(counts, SingleRankInputs)  # a group of one rank sends nothing
        start = self._traffic_now() if counted else None
        if needs_grad(x, topk_weights):
            recv_x, recv_w, plan = RowDispatchFn.apply(x, topk_weights, topk_idx, layout, counts, self)
        else:  # nothing to differentiate: no autograd node (its bookkeeping is host time per call)
            recv_x, recv_w, plan = self._dispatch_rows(x, topk_idx, topk_weights, layout, counts)
        if counted:
            self._finish(start, "dispatch")
        handle = RowHandle(plan, recv_w, plan.tokens_per_local_expert, x.shape[0], topk_weights)
        return recv_x, handle

    def combine(self, y: torch.Tensor, handle: RowHandle) -> torch.Tensor:
        """out[t] = sum_j topk_weights[t, j] * y[copy of (t, j)], weighted and summed at the source.

        Args:
            y: [M, H] expert outputs in recv_x's order (any float dtype; sent in this dtype).
            handle: from the matching ``dispatch``.
        Returns:
            [T, H] float32 (float64 for float64 y), each token's copies summed in float32.
        Raises:
            ValueError: y has the wrong number of rows (local check: a caller bug, not a routing one).
        """
        self._check_combine_input(y, handle)
        counted = self.topology.world_size > 1  # a group of one rank sends nothing: its Traffic stays 0
        start = self._traffic_now() if counted else None
        w = handle.topk_weights
        if needs_grad(y, w):
            out = _FlatCombineFn.apply(y, w, handle.plan, self)
        else:  # nothing to differentiate: no autograd node
            out = self._source_combine(y, w, handle.plan)[0]
        if counted:
            self._finish(start, "combine")
        return out

    def _splits(self, counts: GlobalCounts) -> dict:
        """Host-side split sizes and block offsets, all from the exchanged counts (no device read)."""
        r, me = self.topology.world_size, self.rank
        per_expert = counts.tokens_per_expert
        if r == 1:  # plain Python for the one-rank group: every copy is local
            total = int(per_expert.sum())
            c = per_expert[:, self.local_experts]
            return {"c": c, "num_sent": total, "self_start": 0, "num_self": total, "recv_self_start": 0,
                    "send_splits": [0], "recv_splits": [0], "m": total}  # fmt: skip
        sent = torch.zeros(r, dtype=torch.int64).index_add_(0, self.placement.expert_rank, per_expert[me])
        c = per_expert[:, self.local_experts]  # [R, L] copies from source s for local expert l
        recv = c.sum(1)
        send_o, recv_o = sent.clone(), recv.clone()
        send_o[me] = recv_o[me] = 0
        return {
            "c": c,
            "num_sent": int(sent.sum()),
            "self_start": int(sent[:me].sum()),
            "num_self": int(sent[me]),
            "recv_self_start": int(recv[:me].sum()),
            "send_splits": send_o.tolist(),
            "recv_splits": recv_o.tolist(),
            "m": int(c.sum()),
        }

    def _recv_order(self, sp: dict, dev: torch.device) -> torch.Tensor:
        """[M] row of the source-major receive layout (source, local expert, token) of each output row
        in (local expert, source, token) order: a block transpose, built without a sort."""
        c, m = sp["c"], sp["m"]
        if self.topology.world_size == 1:
            return torch.arange(m, device=dev)
        start_in = (_excl_cumsum(c.sum(1))[:, None] + _excl_cumsum(c, 1)).T.reshape(-1)  # (l, s) order
        lengths = c.T.reshape(-1)
        shift = (start_in - _excl_cumsum(lengths)).to(dev)
        return torch.repeat_interleave(shift, lengths.to(dev), output_size=m) + torch.arange(m, device=dev)

    def _dispatch_rows(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: Layout,
        counts: GlobalCounts,
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllPlan]:
        if isinstance(counts, SingleRankInputs):  # a group of one rank: one counting sort, one read
            return self._dispatch_single_rank(x, topk_idx, topk_weights, counts)
        t, k = topk_idx.shape
        num_local = self.placement.num_local_experts
        dev = x.device
        sp = self._splits(counts)
        m, n_self, s0 = sp["m"], sp["num_self"], sp["self_start"]
        tokens_per_local_expert = sp["c"].sum(0).to(dev)  # right after the counts sync: no wait
        # Sender side: valid slots ordered by (destination rank, local expert, token, slot), by one sort
        # of the flat slots (empty slots get the largest key and fall off the end).
        key = layout.topk_rank * num_local + layout.topk_local
        key = torch.where(topk_idx >= 0, key, self.topology.world_size * num_local).reshape(-1)
        order = torch.sort(key, stable=True).indices[: sp["num_sent"]]
        virtual = self._recv_order(sp, dev)  # output row -> source-major receive row
        self_slots = order[s0 : s0 + n_self]
        send_slot = torch.cat([order[:s0], order[s0 + n_self :]])
        # Receiver side: rows of the source-major layout, the own block at recv_self_start.
        r0 = sp["recv_self_start"]
        is_self = (virtual >= r0) & (virtual < r0 + n_self)
        q = torch.where(virtual < r0, virtual, virtual - n_self)  # row of the collective's buffer
        own = self_slots[(virtual - r0).clamp(0, max(n_self - 1, 0))] if n_self else q
        src_slot = torch.where(is_self, own, t * k + q)
        inverse = torch.empty_like(virtual).scatter_(0, virtual, torch.arange(m, device=dev))
        q_rows = torch.arange(sum(sp["recv_splits"]), device=dev)
        slot_src = torch.full((t * k,), -1, dtype=torch.int64, device=dev)
        slot_src[self_slots] = inverse[r0 : r0 + n_self]
        slot_src[send_slot] = m + torch.arange(send_slot.shape[0], device=dev)
        send_token = torch.div(send_slot, k, rounding_mode="floor")
        plan = AllToAllPlan(
            send_token=send_token,
            send_slot=send_slot,
            send_splits=sp["send_splits"],
            recv_splits=sp["recv_splits"],
            src_row=torch.where(
                src_slot < t * k, torch.div(src_slot, k, rounding_mode="floor"), src_slot - t * k + t
            ),
            src_slot=src_slot,
            recv_out_row=inverse[torch.where(q_rows < r0, q_rows, q_rows + n_self)],
            slot_src=slot_src.view(t, k),
            tokens_per_local_expert=tokens_per_local_expert,
        )
        w_flat = topk_weights.reshape(-1).to(accumulation_dtype(topk_weights.dtype))
        recv_x, recv_w = self._send_payload(x, w_flat, plan)
        return recv_x, recv_w, plan

    def _dispatch_single_rank(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, inputs: SingleRankInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllPlan]:
        """Dispatch in a group of one rank: every copy stays here, so the plan is a sync-free counting sort
        (``rows.single_rank_layout``) and recv_x one gather of x's rows.

        Order of the host work, so that the device never waits for the host after the read: host checks
        (plain Python), the layout kernels, the copy of the layout's ``info`` (min id, max id, M) to
        pinned memory, the payload gather, and only then the read, which waits for the layout alone
        (``PinnedRead``): the host checks the ids' range, slices the plan and returns while the gather
        still runs, so the caller's next kernels (the experts, the combine) queue behind it. Kernels
        treat out-of-range ids as empty slots, so a bad input is reported (``EPInputError``, before any
        result is returned) after harmless work. Inside a CUDA graph capture no read is possible: the
        fixed-capacity form is returned instead (recv_x [T k, H], valid copies first, the rest never read
        by combine; ids not checked).
        """
        check_single_rank(inputs, self.num_experts)  # shapes, devices, dtypes: host only
        _, local_index, _ = self._on(x.device)
        order, row_token, slot_row, row_w, counts, info = single_rank_layout(
            topk_idx, topk_weights, local_index, self.num_experts
        )
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        pending = None if capturing else self._read.start(info)
        none = order[:0]
        if self.fp8_dispatch:
            xq, scale = quantize_rows_fp8(x)
            recv_x = gather_rows2(xq, xq[:0], row_token, scale=scale, out_dtype=x.dtype)
        else:
            recv_x = gather_rows2(x, x[:0], row_token)
        if capturing:
            m = topk_idx.numel()  # fixed capacity: no device read inside a graph
        else:
            lo, hi, m = self._read.finish(info, pending)  # the dispatch's one device sync
            check_single_rank(inputs, self.num_experts, (lo, hi))
        plan = AllToAllPlan(
            send_token=none,
            send_slot=none,
            send_splits=[0],
            recv_splits=[0],
            src_row=row_token[:m],
            src_slot=order[:m],
            recv_out_row=none,
            slot_src=slot_row,
            tokens_per_local_expert=counts,
        )
        return recv_x[:m], row_w[:m], plan

    def _send_payload(
        self, x: torch.Tensor, w_flat: torch.Tensor, plan: AllToAllPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward payload: copies to other ranks through the collective, then one gathering pass."""
        w_send = w_flat[plan.send_slot]
        if not self.fp8_dispatch:
            rx, rw = self._all.exchange_many([x[plan.send_token], w_send], plan.send_splits, plan.recv_splits)
            return gather_rows2(x, rx, plan.src_row), torch.cat([w_flat, rw])[plan.src_slot]
        xq, scale = quantize_rows_fp8(x)
        rx, rs, rw = self._all.exchange_many(
            [xq[plan.send_token], scale[plan.send_token], w_send], plan.send_splits, plan.recv_splits
        )
        recv_x = gather_rows2(xq, rx, plan.src_row, scale=torch.cat([scale, rs]), out_dtype=x.dtype)
        return recv_x, torch.cat([w_flat, rw])[plan.src_slot]

    def _send_back(self, z: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """Rows [M, ...] of copies that came through the collective, back to their senders -> [P_o, ...]."""
        if self.topology.world_size == 1:
            return z[:0]
        (back,) = self._all.exchange_many([z[plan.recv_out_row]], plan.recv_splits, plan.send_splits)
        return back

    def _reverse(self, z: torch.Tensor, plan: AllToAllPlan, wire_dtype: torch.dtype) -> torch.Tensor:
        """D^T z: [M, C] -> [T, C] float32 (float64), each token's copies summed in slot order; rows cross
        links in ``wire_dtype``."""
        z = z.to(wire_dtype)
        return gather_sum2(z, self._send_back(z, plan), plan.slot_src)

    def _reverse_slots(self, g: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        """[M] per-copy values -> [T, k] at their slots (0 for empty slots), in g's dtype."""
        return gather_slots2(g, self._send_back(g, plan), plan.slot_src)

    def _source_combine(
        self, y: torch.Tensor, w: torch.Tensor, plan: AllToAllPlan
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """out[t] = sum_j w[t, j] cat(y, returned)[slot_src[t, j]] in float32, one pass at the source."""
        back = self._send_back(y, plan)
        return gather_sum2(y, back, plan.slot_src, w), (y, back)

    def _source_combine_backward(
        self, g: torch.Tensor, w: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: AllToAllPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_y [M, C] in y's dtype, grad_w [T, k]) of ``_source_combine`` for the output gradient g."""
        y, back = saved
        grad_y, grad_back, grad_w = gather_sum2_backward(g, y, back, plan.slot_src, w)
        (recv,) = self._all.exchange_many([grad_back], plan.send_splits, plan.recv_splits)
        if recv.shape[0]:
            grad_y.index_copy_(0, plan.recv_out_row, recv)
        return grad_y, grad_w


class RowDispatchFn(torch.autograd.Function):
    """recv_x = D x and recv_w = D_w w; backward: D^T g_x (the copies' gradients summed per token) and
    the received weights' gradients back to their slots. Shared by the hierarchical dispatcher, whose
    ``_dispatch_rows`` / ``_reverse`` / ``_reverse_slots`` implement the same three maps its own way."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, layout, counts, disp):  # noqa: D102
        with torch.no_grad():
            recv_x, recv_w, plan = disp._dispatch_rows(x, topk_idx, topk_weights, layout, counts)
        ctx.disp, ctx.plan, ctx.x_dtype, ctx.w_dtype = disp, plan, x.dtype, topk_weights.dtype
        return recv_x, recv_w, plan

    @staticmethod
    def backward(ctx, g_x, g_w, _):  # noqa: D102
        # Both collectives run on every rank whatever needs_input_grad says, so ranks stay in step.
        disp, plan = ctx.disp, ctx.plan
        start = disp._traffic_now()
        grad_x = disp._reverse(g_x, plan, ctx.x_dtype).to(ctx.x_dtype)
        grad_w = disp._reverse_slots(g_w.to(accumulation_dtype(ctx.w_dtype)), plan).to(ctx.w_dtype)
        disp._count(start, "combine")  # gradients go back to the tokens' ranks
        return grad_x, grad_w, None, None, None, None


class _FlatCombineFn(torch.autograd.Function):
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
