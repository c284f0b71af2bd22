"""Topology of an expert-parallel (EP) group: which node each EP rank lives on, and its process groups.

Shape legend: R EP ranks (world size of the EP group), G ranks per node, N = R / G nodes.

EP rank r lives on node ``r // G`` with local index ``r % G`` (the rank's GPU index inside its node).
The hierarchical dispatcher needs two kinds of subgroups, both built here:

- intra-node: the G ranks of one node (NVLink / shared memory on real hardware);
- cross-node: the N ranks that share one local index, one per node (the "rail" of rail-optimized
  networks: GPU i of every node talks to GPU i of the other nodes over RDMA, as DeepEP does).

Nodes may be simulated: 8 processes on one machine can be declared 2 nodes x 4 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Topology:
    """R = ``world_size`` EP ranks laid out as N = R / G nodes of G = ``ranks_per_node`` ranks.

    Raises:
        ValueError: a size below 1, or ``world_size`` not a multiple of ``ranks_per_node``. Every rank
            builds the same Topology from the same arguments, so every rank raises the same error
            before any collective runs (no hang).
    """

    world_size: int
    """R: number of EP ranks."""
    ranks_per_node: int
    """G: EP ranks per (real or simulated) node."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"Topology needs world_size >= 1 and ranks_per_node >= 1, got "
                f"world_size={self.world_size}, ranks_per_node={self.ranks_per_node}"
            )
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"Topology: world_size={self.world_size} is not a multiple of "
                f"ranks_per_node={self.ranks_per_node}"
            )

    @property
    def num_nodes(self) -> int:
        """N = R / G."""
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node index of EP rank ``rank``."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        """Index of EP rank ``rank`` inside its node (0 .. G-1)."""
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The G EP ranks of ``node``, ascending."""
        return [node * self.ranks_per_node + g for g in range(self.ranks_per_node)]

    def rail_ranks(self, local_index: int) -> list[int]:
        """The N EP ranks with local index ``local_index`` (one per node), ordered by node."""
        return [n * self.ranks_per_node + local_index for n in range(self.num_nodes)]

    def is_same_node(self, a: int, b: int) -> bool:
        """Whether EP ranks ``a`` and ``b`` share a node."""
        return self.node_of(a) == self.node_of(b)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"EP rank {rank} is outside [0, {self.world_size})")

    def build_groups(self, group: dist.ProcessGroup | None = None) -> TopologyGroups:
        """Create this rank's intra-node and cross-node subgroups of the EP ``group`` (None = WORLD).

        Collective over ``group``: every member calls it once, in the same order as its other
        ``new_group`` calls. Only the two subgroups containing the caller are created
        (``use_local_synchronization``), so the EP group may be a subgroup of a larger job.

        Raises:
            ValueError: the size of ``group`` is not ``world_size``.
        """
        group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise ValueError(
                f"Topology.world_size={self.world_size} but the EP process group has {size} ranks"
            )
        rank = dist.get_rank(group)
        global_ranks = dist.get_process_group_ranks(group)

        backend = dist.get_backend(group)  # NCCL EP group -> NCCL subgroups, gloo -> gloo

        def sub(ep_ranks: list[int]) -> dist.ProcessGroup:
            members = [global_ranks[r] for r in ep_ranks]
            return dist.new_group(members, backend=backend, use_local_synchronization=True)

        intra = sub(self.node_ranks(self.node_of(rank)))
        cross = sub(self.rail_ranks(self.local_index(rank)))
        return TopologyGroups(topology=self, rank=rank, group=group, intra_node=intra, cross_node=cross)


@dataclass(frozen=True, slots=True)
class TopologyGroups:
    """The process groups of one EP rank (from ``Topology.build_groups``)."""

    topology: Topology
    rank: int
    """This process's EP rank (its rank in ``group``)."""
    group: dist.ProcessGroup
    """The whole EP group (R ranks)."""
    intra_node: dist.ProcessGroup
    """The G ranks of this rank's node; rank g in it is EP rank node * G + g."""
    cross_node: dist.ProcessGroup
    """The N ranks with this rank's local index; rank n in it is EP rank n * G + local_index."""

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.topology.node_of(self.rank)

    @property
    def local_index(self) -> int:
        """This rank's index inside its node."""
        return self.topology.local_index(self.rank)
