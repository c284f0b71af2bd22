"""Full tensors from a sharded policy, gathered one at a time and streamed to the weight store in buckets.

Shape legend: E routed experts, L local experts of an EP rank, P EP ranks.

A dense parameter's full tensor is ``DTensor.full_tensor()`` (an all-gather over its FSDP2 mesh). An
expert tensor is gathered twice: over "dp" (the EP shard [L, ...]) and then over the EP group
(``all_gather`` of the P shards, placed by their global expert ids into [E, ...]). Every rank takes part
in every gather, in the same (name) order; only rank 0 keeps the tensors, and only one bucket of
``runtime.publish_bucket_mb`` at a time, which it writes as one safetensors file of the version
(``publish_sharded``), or packs and hands on (``stream_sharded``: ``runtime.weight_sync=object_store``,
each bucket put into Ray's object store and offered to the workers as soon as it is gathered).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moerl.ep.parallelize import ExpertParallelExperts
from moerl.records import WeightVersion
from moerl.trainer.distributed.mesh import TrainMesh
from moerl.weights.buckets import BucketPacker, StreamedVersion, WeightBucket
from moerl.weights.store import WeightStore


def _global_shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (full shape, dtype) of every state-dict tensor, experts at their global E (no communication)."""
    num_experts = {
        f"{name}.{p}": m.dispatcher.num_experts
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelExperts)
        for p in ("gate_up_proj", "down_proj")
    }
    out = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name in num_experts:
            shape = (num_experts[name], *shape[1:])
        out[name] = (shape, t.dtype)
    return out


def _full_tensor(name: str, t: torch.Tensor, experts: dict[str, ExpertParallelExperts]) -> torch.Tensor:
    """The whole tensor ``name`` on every rank (collective over the tensor's meshes)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    module = experts.get(name.rsplit(".", 1)[0])
    if module is None:
        return full
    group = module.dispatcher.group
    size = dist.get_world_size(group)
    parts = [torch.empty_like(full) for _ in range(size)]
    dist.all_gather(parts, full.contiguous(), group=group)
    ids = [torch.empty_like(module.local_expert_ids) for _ in range(size)]
    dist.all_gather(ids, module.local_expert_ids.contiguous(), group=group)
    out = torch.empty((module.dispatcher.num_experts, *full.shape[1:]), dtype=full.dtype, device=full.device)
    out[torch.cat(ids)] = torch.cat(parts)
    return out


def iter_full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) of every state-dict entry, in sorted name order. Collective: every rank
    must exhaust the iterator; each yields the same tensors (rank 0 usually keeps them)."""
    experts = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    state = model.state_dict()
    for name in sorted(state):
        yield name, _full_tensor(name, state[name], experts).to("cpu")


def plan_buckets(model: torch.nn.Module, bucket_bytes: int) -> list[list[str]]:
    """Sorted tensor names cut into consecutive buckets of at most ``bucket_bytes`` (at least one tensor
    each), from the global shapes: the same plan on every rank, before anything is gathered."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in sorted(_global_shapes(model).items()):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def publish_sharded(
    model: torch.nn.Module, mesh: TrainMesh, store: WeightStore | None, version: int, bucket_bytes: int
) -> WeightVersion | None:
    """Publish the sharded ``model`` as ``version`` of ``store``, bucket by bucket (collective).

    Rank 0 writes (``store`` is used only there; other ranks may pass None); returns its committed
    ``WeightVersion``, None on the other ranks. The version's format is ``WeightStore.publish``'s.
    """
    plan = plan_buckets(model, bucket_bytes)
    tensors = iter_full_tensors(model)

    def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for names in plan:
            yield [next(tensors) for _ in names]

    if mesh.rank != 0:
        for _ in buckets():
            pass
        return None
    return store.publish_buckets(version, buckets(), num_buckets=len(plan))


def stream_sharded(
    model: torch.nn.Module,
    mesh: TrainMesh,
    version: int,
    bucket_bytes: int,
    send: Callable[[WeightBucket], object],
) -> StreamedVersion | None:
    """Stream the sharded ``model`` as ``version``, bucket by bucket (collective).

    The buckets are ``plan_buckets``'; each is gathered (every rank takes part), then rank 0 packs it
    (``moerl.weights.buckets.pack_bucket``: one flat buffer + xxh3, into a staging buffer reused for
    every bucket; on CUDA through pinned memory) and calls ``send(bucket) -> ref`` (``ray.put`` and the
    offers to the workers), which must copy the bytes before it returns. Rank 0 holds one bucket of full
    tensors at a time and never the whole model.

    Returns:
        On rank 0 the ``StreamedVersion`` (the refs ``send`` returned, in bucket order); None elsewhere.
    """
    t0 = time.perf_counter()
    plan = plan_buckets(model, bucket_bytes)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    state = model.state_dict()
    packer, refs, nbytes = BucketPacker(), [], 0
    for i, names in enumerate(plan):
        tensors = [(name, _full_tensor(name, state[name], experts)) for name in names]
        if mesh.rank != 0:
            continue
        bucket = packer.pack(version, i, len(plan), tensors)
        refs.append(send(bucket))
        nbytes += bucket.nbytes
        del bucket, tensors
    if mesh.rank != 0:
        return None
    return StreamedVersion(version, tuple(refs), nbytes, time.perf_counter() - t0)
