"""Communication helpers shared by the dispatchers: input validation agreed by every rank, row
packing, an all-to-all with byte accounting, and a deterministic gather-sum.

Shape legend: P rows sent, Q rows received, B bytes per packed row, C channels per row, S sources
reduced per output row, R EP ranks, E routed experts, N nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.ep.layout import Traffic, send_traffic
from moerl.ep.rows import accumulation_dtype, gather_sum2  # noqa: F401 (accumulation_dtype: re-exported)
from moerl.ep.topology import Topology

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # status, T, H, k, x dtype code, weights dtype code, min id, max id


class EPInputError(ValueError):
    """Dispatch inputs are invalid on at least one EP rank; raised on every rank with the same verdict."""


@dataclass(frozen=True)
class GlobalCounts:
    """Every rank's routing counts, all-gathered before any payload moves (CPU tensors)."""

    num_tokens: torch.Tensor
    """[R] int64 tokens on each source rank."""
    tokens_per_expert: torch.Tensor
    """[R, E] int64 copies each source rank routes to each expert."""
    tokens_per_rank: torch.Tensor
    """[R, R] int64 tokens of source rank s that need destination rank d."""
    tokens_per_node: torch.Tensor
    """[R, N] int64 tokens of source rank s that need node n."""


def exchange_counts(
    problem: str | None,
    x_shape: tuple[int, ...],
    k: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    local_counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    num_experts: int,
    topology: Topology,
    group: dist.ProcessGroup,
    device: torch.device,
    topk_idx: torch.Tensor | None = None,
) -> GlobalCounts:
    """All-gather every rank's verdict on its inputs and its routing counts (one collective, and the
    dispatch's only device sync: the range check of the expert ids travels in the same table).

    Args:
        problem: this rank's input problem (``check_topk_idx`` with ``check_range=False``), None when valid.
        dtypes: (x dtype, topk_weights dtype).
        local_counts: (tokens_per_expert [E], tokens_per_rank [R], tokens_per_node [N]) or None with a problem.
        topk_idx: [T, k] int64 expert ids whose range [-1, E) is checked here (None: not checked).
    Raises:
        EPInputError: on every rank, when any rank reported a problem, has ids outside [-1, E), or ranks
            disagree on H, k or dtypes.
    """
    r, n = topology.world_size, topology.num_nodes
    width = _HEADER + num_experts + r + n
    head = torch.zeros(6, dtype=torch.int64)
    if problem is None:
        codes = [_DTYPES.index(d) if d in _DTYPES else len(_DTYPES) for d in dtypes]
        head = torch.tensor([0, x_shape[0], x_shape[1], k, *codes], dtype=torch.int64)
        if topk_idx is not None and topk_idx.numel():
            span = torch.stack([topk_idx.min(), topk_idx.max()])
        else:
            span = torch.full((2,), -1, dtype=torch.int64, device=device)
        body = torch.cat([span, *(c.to(device) for c in local_counts)])
    else:
        head[0] = 1
        body = torch.zeros(width - 6, dtype=torch.int64, device=device)
    if r == 1:  # a world of one: nothing to gather; the header never leaves the host
        table = torch.cat([head, body.cpu()])[None]  # device sync
    else:
        # pinned + non_blocking: a pageable host-to-device copy would wait for the device's queue
        on_device = (
            head.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else head.to(device)
        )
        mine = torch.cat([on_device, body])
        parts = [torch.empty_like(mine) for _ in range(r)]
        dist.all_gather(parts, mine, group=group)  # collective: every rank, even one with bad input
        table = torch.stack(parts).cpu()  # device sync
    _raise_on_problems(table, problem, dist.get_rank(group), num_experts)
    e_end = _HEADER + num_experts
    return GlobalCounts(
        num_tokens=table[:, 1],
        tokens_per_expert=table[:, _HEADER:e_end],
        tokens_per_rank=table[:, e_end : e_end + r],
        tokens_per_node=table[:, e_end + r :],
    )


@dataclass(frozen=True)
class SingleRankInputs:
    """What a group of one rank knows about its dispatch inputs before any device work: the host-side
    verdict of ``check_topk_idx`` and the values ``check_single_rank`` compares (no routing counts:
    ``moerl.ep.rows.single_rank_layout`` makes them on the device, without a sync)."""

    problem: str | None
    x_shape: tuple[int, ...]
    k: int
    dtypes: tuple[torch.dtype, torch.dtype]


def check_single_rank(
    inputs: SingleRankInputs, num_experts: int, span: tuple[int, int] | None = None
) -> None:
    """``exchange_counts``'s checks and error messages for a group of one rank, without a table (plain
    Python on a few ints: it runs between the dispatch's device read and the return of its results).

    Args:
        inputs: the host-side facts (``SingleRankInputs``).
        span: (min id, max id) of ``topk_idx`` once read from the device, or None before (only the host
            checks run then: shapes, devices, dtypes).
    Raises:
        EPInputError: the inputs are invalid (as ``exchange_counts``).
    """
    codes = [_DTYPES.index(d) if d in _DTYPES else len(_DTYPES) for d in inputs.dtypes]
    lo, hi = span if span is not None else (-1, -1)
    shape = inputs.x_shape
    head = [1, 0, 0, 0, 0, 0, -1, -1] if inputs.problem else [0, shape[0], shape[1], inputs.k, *codes, lo, hi]
    _raise_on_heads([head], inputs.problem, 0, num_experts)


def _raise_on_problems(table: torch.Tensor, problem: str | None, rank: int, num_experts: int) -> None:
    _raise_on_heads(table[:, :_HEADER].tolist(), problem, rank, num_experts)  # a few rows of 8 ints


def _raise_on_heads(heads: list[list[int]], problem: str | None, rank: int, num_experts: int) -> None:
    """Raise ``EPInputError`` for the first problem in the ranks' table heads ([R] rows of _HEADER ints)."""
    out_of_range = [h[0] == 0 and (h[6] < -1 or h[7] >= num_experts) for h in heads]
    if problem is None and out_of_range[rank]:
        lo, hi = heads[rank][6], heads[rank][7]
        problem = f"topk_idx has ids in [{lo}, {hi}]; allowed [0, {num_experts}) and -1 for none"
    bad = [i for i, h in enumerate(heads) if h[0] != 0 or out_of_range[i]]
    if bad:
        here = f"; on this rank ({rank}): {problem}" if problem else ""
        raise EPInputError(f"EP dispatch: invalid inputs on rank(s) {bad}{here}")
    for col, name in ((2, "hidden size H"), (3, "top-k"), (4, "x dtype"), (5, "topk_weights dtype")):
        values = [h[col] for h in heads]
        if len(set(values)) > 1:
            shown = [str(_DTYPES[v]) if col >= 4 and v < len(_DTYPES) else v for v in values]
            raise EPInputError(f"EP dispatch: ranks disagree on {name}: per rank {shown}")
        if col >= 4 and values[0] >= len(_DTYPES):
            raise EPInputError(f"EP dispatch: {name} must be one of {_DTYPES}")


class PinnedRead:
    """Reads of small device tensors that do not wait for the work queued after them: each ``start``
    copies the tensor into a pinned host buffer (reused per device, dtype and size) and records an event
    behind the copy; ``finish`` waits for that event only, so kernels queued between the two keep the
    device busy while the host waits and then goes on. CPU tensors are read directly.

    Not for concurrent use from several threads (the buffer is reused); a ``finish`` must follow each
    ``start`` before the next ``start`` of the same size.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """Queue the copy of t [n] to the host on t's current stream; None for a CPU tensor."""
        if not t.is_cuda:
            return None
        key = (t.device, t.dtype, t.numel())
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = (
                torch.empty(t.numel(), dtype=t.dtype, pin_memory=True),
                torch.cuda.Event(),
            )
        buf, event = slot
        buf.copy_(t, non_blocking=True)
        event.record(torch.cuda.current_stream(t.device))
        return slot

    @staticmethod
    def finish(t: torch.Tensor, pending: tuple[torch.Tensor, torch.cuda.Event] | None) -> list:
        """t's values as a list (a host sync: waits for the copy ``start`` queued, not for later work)."""
        if pending is None:
            return t.tolist()
        buf, event = pending
        event.synchronize()
        return buf.tolist()


def pack_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the rows of tensors [P, ...] (any dtypes) into one uint8 tensor [P, B]."""
    p = tensors[0].shape[0]
    return torch.cat([as_bytes(t, p) for t in tensors], dim=1)


def as_bytes(t: torch.Tensor, p: int) -> torch.Tensor:
    """[P, ...] of any dtype -> [P, bytes per row] uint8 (a view when t is contiguous)."""
    width = t[0].numel() if p else int(torch.tensor(t.shape[1:]).prod())
    return t.contiguous().reshape(p, width).view(torch.uint8)


def unpack_rows(buf: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Split uint8 rows [Q, B] into tensors of the given (dtype, per-row shape)."""
    out, col, q = [], 0, buf.shape[0]
    for dtype, shape in specs:
        nbytes = int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size()
        out.append(buf[:, col : col + nbytes].contiguous().view(dtype).reshape(q, *shape))
        col += nbytes
    return out


class Link:
    """All-to-all over one process group whose member i is EP rank ``ep_ranks[i]``; accumulates Traffic."""

    def __init__(
        self, group: dist.ProcessGroup, ep_ranks: list[int], my_rank: int, topology: Topology
    ) -> None:
        self.group, self.ep_ranks, self.my_rank, self.topology = group, ep_ranks, my_rank, topology
        self.traffic = Traffic()

    def exchange(self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send rows [P, ...] (P = sum send_splits, grouped by destination member) and receive
        [sum recv_splits, ...] grouped by source member. Collective over the group."""
        return self.exchange_many([rows], send_splits, recv_splits)[0]

    def exchange_many(
        self, tensors: list[torch.Tensor], send_splits: list[int], recv_splits: list[int]
    ) -> list[torch.Tensor]:
        """``exchange`` of several row tensors with the same splits (e.g. a payload and its per-row weights
        or scales): one all-to-all each, counted as one message per destination of the summed row bytes.
        A group of one rank moves nothing: its rows are returned as they are (no copy, no collective)."""
        if dist.get_world_size(self.group) == 1:
            return list(tensors)
        out, row_bytes = [], 0
        for rows in tensors:
            p, shape, dtype = rows.shape[0], rows.shape[1:], rows.dtype
            send = as_bytes(rows, p)
            width = send.shape[1]
            recv = torch.empty(sum(recv_splits), width, dtype=torch.uint8, device=rows.device)
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
            out.append(recv.view(dtype).reshape(recv.shape[0], *shape))
            row_bytes += width
        self.traffic = self.traffic + send_traffic(
            self.topology, self.my_rank, self.ep_ranks, send_splits, row_bytes
        )
        return out


def gather_sum(buf: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_s w[t, s] * buf[pos[t, s]] in float32 (float64 for float64 buf); w = 1 without
    ``weights`` [T, S]; ``pos == buf.shape[0]`` contributes zero. buf [P, C], pos [T, S] int64 -> [T, C].
    One Triton kernel on CUDA (``moerl.ep.rows.gather_sum2``), summed in slot order s = 0, 1, ... on the
    tensor-op path; deterministic either way."""
    return gather_sum2(buf, buf[:0], torch.where(pos < buf.shape[0], pos, -1), weights)


def gather_slots(values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[t, s] = values[pos[t, s]] (0 where pos == len(values)); values [P], pos [T, S] -> [T, S]."""
    return torch.cat([values, values.new_zeros(1)])[pos]


def inverse_positions(order_keys: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """For P entries with flat slot ids ``order_keys`` [P] (row * width + column), return pos [num_rows, width]
    holding each entry's index, and P where no entry maps (the zero row of ``gather_sum``)."""
    p = order_keys.shape[0]
    pos = torch.full((num_rows * width,), p, dtype=torch.int64, device=order_keys.device)
    pos[order_keys] = torch.arange(p, device=order_keys.device)
    return pos.view(num_rows, width)
