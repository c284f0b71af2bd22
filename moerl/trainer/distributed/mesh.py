"""The training group's DeviceMesh: data-parallel sharding (FSDP2) x expert parallelism (EP).

R = ``trainer.num_ranks`` ranks, EP degree P = ``trainer.ep_size``, D = R / P replicas of each expert
shard. Rank r has EP rank ``r % P`` and data-parallel (dp) index ``r // P``: an EP group is P
consecutive ranks (so it fills nodes first: NVLink before the network), and the ranks holding the
same experts are ``{e, e + P, e + 2P, ...}``. Every rank trains its own slice of the batch.

    world mesh ("fsdp", R):       dense parameters (attention, router, norms, embeddings) are
                                  FSDP2-sharded over all R ranks.
    mesh ("dp", D) x ("ep", P):   routed experts are split over "ep" (``moerl.ep.parallelize``),
                                  each EP shard is FSDP2-sharded over "dp".
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moerl.ep.topology import Topology

COLLECTIVE_TIMEOUT_S = 120.0
"""Default timeout of every collective of the training group: a rank that hangs or died makes its
peers raise instead of waiting forever (``init_process_group(timeout=...)``)."""


@dataclass(frozen=True)
class TrainMesh:
    """This rank's view of the training group's meshes and process groups."""

    rank: int
    """Global rank in the training group."""
    num_ranks: int
    """R, size of the training group."""
    ep_size: int
    """P, the EP degree."""
    world: DeviceMesh
    """1-D mesh ("fsdp",) over all R ranks: the FSDP2 mesh of the dense parameters."""
    mesh_2d: DeviceMesh
    """2-D mesh ("dp", "ep") of shape (R / P, P)."""
    topology: Topology
    """Node layout of this rank's EP group (P ranks, ``min(gpus_per_node, P)`` per node)."""
    ep_major: DeviceMesh
    """2-D mesh ("ep", "dp") of shape (P, R / P), the transpose of ``mesh_2d``: an expert tensor
    [E, ...] placed ``(Shard(0), Shard(0))`` on it is split over EP ranks first, then FSDP2-style over
    dp, which is exactly how the experts are held (the global view checkpoints use)."""

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh ("dp",) of the R / P ranks that hold this rank's experts: their FSDP2 mesh."""
        return self.mesh_2d["dp"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """Process group of this rank's EP group (P consecutive ranks)."""
        return self.mesh_2d["ep"].get_group()

    @property
    def ep_rank(self) -> int:
        """This rank's index in its EP group."""
        return self.rank % self.ep_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks holding the same experts."""
        return self.rank // self.ep_size


def init_group(
    backend: str, init_method: str, rank: int, num_ranks: int, *, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> None:
    """Join the default process group with a timeout on every collective.

    Args:
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA).
        init_method: rendezvous URL (``file://...`` or ``tcp://host:port``).
        rank, num_ranks: this process's rank and the group size.
        timeout_s: seconds any collective may wait for its peers before raising.
    """
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=num_ranks,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def build_mesh(ep_size: int, gpus_per_node: int, device_type: str = "cpu") -> TrainMesh:
    """The meshes of the already initialized default group (collective: every rank calls it).

    Raises:
        ValueError: ``ep_size`` does not divide the group size, or the EP group is not whole nodes.
    """
    num_ranks, rank = dist.get_world_size(), dist.get_rank()
    if num_ranks % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {num_ranks} ranks of the training group")
    ranks = torch.arange(num_ranks)
    world = DeviceMesh(device_type, ranks, mesh_dim_names=("fsdp",))
    grid = ranks.view(num_ranks // ep_size, ep_size)
    mesh_2d = DeviceMesh(device_type, grid, mesh_dim_names=("dp", "ep"))
    ep_major = DeviceMesh(device_type, grid.t().contiguous(), mesh_dim_names=("ep", "dp"))
    topology = Topology(ep_size, min(gpus_per_node, ep_size))
    return TrainMesh(rank, num_ranks, ep_size, world, mesh_2d, topology, ep_major)
