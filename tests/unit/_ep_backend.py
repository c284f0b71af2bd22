"""A test-only EP dispatcher backend in one file: what a DeepEP adapter would look like, with the flat
dispatcher standing in for the library.

A library such as DeepEP offers ``dispatch`` and ``combine`` without autograd (``deep_ep.Buffer``); the
backend owns the backward. Here the "library" is an ``AllToAllDispatcher`` called only under
``torch.no_grad``, and this file writes the adjoints from its public ``dispatch``/``combine`` alone:

    backward(dispatch)(g)  = D^T g            one combine with unit weights
    backward(combine)(g)   = w * D g          one dispatch of g (its recv_weights are w per copy)
    grad_w[t, j]           = <g[t], y[copy (t, j)]>   k combines with one-hot weights

It is slower than the built-in dispatchers (k + 1 extra collectives in backward) and is registered only
inside the tests (``DISPATCHERS["delegating"]``), which then build it by name through ``parallelize``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moerl.ep import AllToAllDispatcher, ExpertPlacement, Topology, Traffic


@dataclasses.dataclass(frozen=True)
class DelegatingHandle:
    """``moerl.ep.DispatchHandle`` of this backend."""

    tokens_per_local_expert: torch.Tensor
    """[L] int64 received copies per local expert."""
    num_tokens: int
    """T, rows of combine's output."""
    library: object
    """The library's own handle (here the flat dispatcher's ``RowHandle``)."""
    topk_idx: torch.Tensor
    """[T, k] int64 expert ids as given to dispatch (backward re-dispatches with them)."""
    topk_weights: torch.Tensor
    """[T, k] router weights as given to dispatch (differentiable; combine applies them)."""


class DelegatingDispatcher:
    """``moerl.ep.Dispatcher`` over a no-grad "library" (a flat dispatcher), owning its autograd.

    Args: as ``moerl.ep.DispatcherBuilder``.
    """

    def __init__(
        self,
        topology: Topology,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        placement: str | ExpertPlacement = "contiguous",
    ) -> None:
        self.library = AllToAllDispatcher(topology, num_experts, group, placement=placement)
        self.num_experts = num_experts
        self.local_experts = self.library.local_experts

    @property
    def last_traffic(self) -> Traffic:
        """The library's bytes of the last forward call."""
        return self.library.last_traffic

    @property
    def total_traffic(self) -> Traffic:
        """The library's bytes since construction (backward's extra calls included)."""
        return self.library.total_traffic

    @property
    def traffic_by_direction(self) -> dict[str, Traffic]:
        """The library's bytes by direction."""
        return self.library.traffic_by_direction

    def dispatch(self, x, topk_idx, topk_weights):
        """x [T, H], topk_idx [T, k], topk_weights [T, k] -> (recv_x [M, H], DelegatingHandle)."""
        recv_x, lib = _Dispatch.apply(x, topk_weights, topk_idx, self)
        return recv_x, DelegatingHandle(lib.tokens_per_local_expert, x.shape[0], lib, topk_idx, topk_weights)

    def combine(self, y, handle):
        """y [M, H] -> [T, H] float32 = sum_j w[t, j] y[copy (t, j)]."""
        return _Combine.apply(y, handle.topk_weights, self, handle)

    def _combine_with(self, y: torch.Tensor, handle: DelegatingHandle, w: torch.Tensor) -> torch.Tensor:
        """The library's combine of y with weights w [T, k] in place of the router's (no autograd)."""
        with torch.no_grad():
            return self.library.combine(y, dataclasses.replace(handle.library, topk_weights=w))


class _Dispatch(torch.autograd.Function):
    """recv_x = D x (computed by the library); backward: D^T g, a combine with unit weights."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, disp):  # noqa: D102
        recv_x, lib = disp.library.dispatch(x, topk_idx, topk_weights)  # forward runs without autograd
        ctx.disp, ctx.lib, ctx.x_dtype = disp, lib, x.dtype
        ctx.ones = torch.ones(topk_idx.shape, dtype=torch.float32, device=x.device)
        return recv_x, lib

    @staticmethod
    def backward(ctx, g, _):  # noqa: D102
        # topk_weights get their gradient through combine; dispatch only carries them
        with torch.no_grad():
            grad_x = ctx.disp.library.combine(g, dataclasses.replace(ctx.lib, topk_weights=ctx.ones))
        return grad_x.to(ctx.x_dtype), None, None, None


class _Combine(torch.autograd.Function):
    """out = D^T (w y); backward: grad_y = w D g (a dispatch of g), grad_w[t, j] = <g[t], y[copy (t, j)]>."""

    @staticmethod
    def forward(ctx, y, w, disp, handle):  # noqa: D102
        ctx.disp, ctx.handle = disp, handle
        ctx.save_for_backward(y, w)
        return disp._combine_with(y, handle, w.detach())

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        y, w = ctx.saved_tensors
        disp, handle = ctx.disp, ctx.handle
        with torch.no_grad():
            g_rows, g_handle = disp.library.dispatch(g.to(y.dtype), handle.topk_idx, w)
        grad_y = (g_handle.recv_weights[:, None] * g_rows).to(y.dtype)
        k = w.shape[1]
        grad_w = torch.stack(
            [(g * disp._combine_with(y, handle, torch.eye(k, dtype=w.dtype, device=w.device)[j].expand_as(w))).sum(-1)
             for j in range(k)],
            dim=1,
        )  # fmt: skip
        return grad_y, grad_w.to(w.dtype), None, None
