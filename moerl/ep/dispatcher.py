"""The EP dispatcher interface: ``dispatch`` tokens to their experts' ranks, ``combine`` the experts'
outputs back to the tokens. Every backend implements it whole, autograd included.

Shape legend: T tokens on this rank, H hidden size, k experts per token (top-k), E routed experts,
L local experts on this rank, M (token, local expert) copies received by this rank.

Both dispatch and combine are linear maps, so each is the other's adjoint (transpose):

    dispatch:  recv_x = D x                 (copy token t to each of its experts)
    combine:   out    = D^T (w * y)         (weight each copy, sum the copies of a token)

hence backward(dispatch)(g) = D^T g (an unweighted combine) and backward(combine)(g) = w * D g (a
dispatch), plus the router-weight gradient grad_w[t, j] = <g[t], y[copy (t, j)]>. A backend writes
these as its own ``torch.autograd.Function``s around its own data movement: the flat all-to-all
(``alltoall.py``) weights at the source and forms grad_w there; the hierarchical dispatcher
(``hierarchical.py``) weights on the expert's rank and sends grad_w back along the combine path; a
DeepEP backend would wrap ``Buffer.dispatch`` / ``Buffer.combine`` the same way (each is the other's
backward, with the handle DeepEP returns). See README.md, "Adding a backend".
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moerl.ep.layout import Traffic
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology


@runtime_checkable
class DispatchHandle(Protocol):
    """What a backend's ``combine`` needs from the matching ``dispatch``; the caller reads two fields, the
    rest (routing plan, received weights, a library's own handle) is the backend's own."""

    tokens_per_local_expert: torch.Tensor
    """[L] int64 received copies per local expert, in local order (sums to M): the grouped GEMM's sizes."""
    num_tokens: int
    """T, tokens this rank dispatched (rows of combine's output)."""


@runtime_checkable
class Dispatcher(Protocol):
    """Token dispatch and combine over an EP group, differentiable, one instance shared by a model's MoE
    layers (``moerl.ep.parallelize``).

    Contract of every implementation:

    - ``dispatch`` and ``combine`` are collectives over the EP group: every rank calls them the same
      number of times in the same order, also a rank with T = 0 tokens; so are their backward passes.
    - Rows are grouped by local expert in local order (``local_experts``), so one grouped GEMM runs over
      them; within an expert the order is the backend's (the built-in ones: source rank, then token).
    - Gradients flow to ``x`` (through dispatch), to ``y`` and to the router weights ``topk_weights``
      (through combine) under autograd; each backend owns its backward. Calls under ``torch.no_grad``
      (rollout) move the same rows.
    - Bad input raises on every rank (``moerl.ep.EPInputError``), never leaves a rank waiting in a
      collective.
    - ``traffic_by_direction`` counts the bytes this rank sent to other ranks (``Traffic``), backward
      included: ``dispatch`` towards the experts' ranks, ``combine`` back to the tokens' ranks.
    """

    num_experts: int
    """E routed experts per MoE layer."""
    local_experts: torch.Tensor
    """[L] int64 global ids of this rank's experts, in local order (the rows' and the weights' order)."""
    last_traffic: Traffic
    """Bytes this rank sent in the last forward ``dispatch`` or ``combine``."""
    total_traffic: Traffic
    """Bytes this rank sent since construction, backward passes included."""
    traffic_by_direction: dict[str, Traffic]
    """``total_traffic`` split into ``"dispatch"`` and ``"combine"`` (by the direction the data moved)."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, DispatchHandle]:
        """Send each token to the EP ranks of its experts.

        Args:
            x: [T, H] float32/bfloat16/float16 tokens (T may be 0; H and dtype equal on all ranks).
            topk_idx: [T, k] int64 global expert ids in [0, E), -1 = empty slot.
            topk_weights: [T, k] float router weights (applied, and differentiated, by ``combine``).
        Returns:
            (recv_x [M, H] in x's dtype grouped by local expert, handle for ``combine``;
            ``handle.tokens_per_local_expert`` [L] gives the group sizes). A backend may return more
            rows than M (a fixed-capacity buffer) if its ``combine`` never reads the extra ones.
        Raises:
            EPInputError: on every rank, when any rank's inputs are invalid.
        """
        ...

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return expert outputs to their tokens: out[t] = sum_j topk_weights[t, j] * y[copy of (t, j)].

        Args:
            y: [M, H] expert outputs in recv_x's order.
            handle: from the matching ``dispatch`` on this rank.
        Returns:
            [T, H]: float32 from the built-in dispatchers (float64 for float64 y), a backend may return
            y's dtype; callers cast to x's dtype.
        Raises:
            ValueError: y does not match the handle (a caller bug).
        """
        ...


class DispatcherBuilder(Protocol):
    """How ``moerl.ep.registry.DISPATCHERS`` builds a backend by name (a class is one)."""

    def __call__(
        self,
        topology: Topology,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        placement: str | ExpertPlacement = "contiguous",
    ) -> Dispatcher:
        """Build a dispatcher over ``group`` (collective: every member calls it in the same order).

        Args:
            topology: the EP ranks' node layout; its world size equals the group's size.
            num_experts: E, a multiple of the EP world size.
            group: the EP process group (None = the default group).
            placement: ``"contiguous"``, ``"round_robin"`` or an ``ExpertPlacement``.
        Raises:
            ValueError: the group does not match the topology, or a placement the backend cannot serve.
        """
        ...
