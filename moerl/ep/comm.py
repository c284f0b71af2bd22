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
from moerl.ep.topology import Topology

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 6  # status, T, H, k, x dtype code, weights dtype code


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
) -> GlobalCounts:
    """All-gather every rank's verdict on its inputs and its routing counts (one collective).

    Args:
        problem: this rank's input problem (``check_topk_idx``), None when valid.
        dtypes: (x dtype, topk_weights dtype).
        local_counts: (tokens_per_expert [E], tokens_per_rank [R], tokens_per_node [N]) or None with a problem.
    Raises:
        EPInputError: on every rank, when any rank reported a problem or ranks disagree on H, k or dtypes.
    """
    r, n = topology.world_size, topology.num_nodes
    width = _HEADER + num_experts + r + n
    mine = torch.zeros(width, dtype=torch.int64, device=device)
    if problem is None:
        codes = [_DTYPES.index(d) if d in _DTYPES else len(_DTYPES) for d in dtypes]
        mine[:_HEADER] = torch.tensor([0, x_shape[0], x_shape[1], k, *codes])
        mine[_HEADER:] = torch.cat([c.to(device) for c in local_counts])
    else:
        mine[0] = 1
    parts = [torch.empty_like(mine) for _ in range(r)]
    dist.all_gather(parts, mine, group=group)  # collective: every rank, even one with bad input
    table = torch.stack(parts).cpu()  # device sync
    _raise_on_problems(table, problem, dist.get_rank(group))
    e_end = _HEADER + num_experts
    return GlobalCounts(
        num_tokens=table[:, 1],
        tokens_per_expert=table[:, _HEADER:e_end],
        tokens_per_rank=table[:, e_end : e_end + r],
        tokens_per_node=table[:, e_end + r :],
    )


def _raise_on_problems(table: torch.Tensor, problem: str | None, rank: int) -> None:
    bad = torch.nonzero(table[:, 0]).flatten().tolist()
    if bad:
        here = f"; on this rank ({rank}): {problem}" if problem else ""
        raise EPInputError(f"EP dispatch: invalid inputs on rank(s) {bad}{here}")
    for col, name in ((2, "hidden size H"), (3, "top-k"), (4, "x dtype"), (5, "topk_weights dtype")):
        values = table[:, col].tolist()
        if len(set(values)) > 1:
            shown = [str(_DTYPES[v]) if col >= 4 and v < len(_DTYPES) else v for v in values]
            raise EPInputError(f"EP dispatch: ranks disagree on {name}: per rank {shown}")
        if col >= 4 and values[0] >= len(_DTYPES):
            raise EPInputError(f"EP dispatch: {name} must be one of {_DTYPES}")


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
        p, shape, dtype = rows.shape[0], rows.shape[1:], rows.dtype
        send = as_bytes(rows, p)
        row_bytes = int(torch.tensor(shape).prod()) * rows.element_size()
        recv = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=rows.device)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        self.traffic = self.traffic + send_traffic(
            self.topology, self.my_rank, self.ep_ranks, send_splits, row_bytes
        )
        return recv.view(dtype).reshape(recv.shape[0], *shape)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64 (so gradcheck can run in float64)."""
    return torch.promote_types(dtype, torch.float32)


def gather_sum(buf: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_s buf[pos[t, s]] in float32 (float64 for float64 buf), summed in column order
    s = 0, 1, ... (deterministic); ``pos == buf.shape[0]`` contributes zero. buf [P, C], pos [T, S] int64
    -> [T, C]."""
    acc = accumulation_dtype(buf.dtype)
    padded = torch.cat([buf.to(acc), buf.new_zeros(1, buf.shape[1], dtype=acc)])
    out = padded.new_zeros(pos.shape[0], buf.shape[1])
    for s in range(pos.shape[1]):
        out += padded[pos[:, s]]
    return out


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
