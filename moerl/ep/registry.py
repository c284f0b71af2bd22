"""The EP dispatcher backends by name: the one table the config's choices, the CLI and ``parallelize``
read. Adding a backend is one file implementing ``moerl.ep.Dispatcher`` and one line here.

Importing this module loads ``moerl.ep`` and torch, not ``moerl.models``.
"""

from __future__ import annotations

import torch.distributed as dist

from moerl.ep.alltoall import AllToAllDispatcher
from moerl.ep.dispatcher import Dispatcher, DispatcherBuilder
from moerl.ep.hierarchical import HierarchicalDispatcher
from moerl.ep.placement import ExpertPlacement
from moerl.ep.topology import Topology

DISPATCHERS: dict[str, DispatcherBuilder] = {
    "alltoall": AllToAllDispatcher,
    "hierarchical": HierarchicalDispatcher,
}
"""Backend name -> its builder ``(topology, num_experts, group=None, *, placement) -> Dispatcher``."""


def build_dispatcher(
    name: str,
    topology: Topology,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    placement: str | ExpertPlacement = "contiguous",
) -> Dispatcher:
    """Build the backend registered as ``name`` over ``group`` (collective: every member calls it).

    Args:
        name: a key of ``DISPATCHERS``.
        topology, num_experts, group, placement: as ``DispatcherBuilder``.
    Raises:
        ValueError: an unknown name (the message lists the registered ones), or the backend's own
            ``ValueError`` (group size != topology.world_size, a bad placement).
    """
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[name](topology, num_experts, group, placement=placement)
