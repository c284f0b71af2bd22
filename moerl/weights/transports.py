"""The Ray-side weight transports of ``runtime.weight_sync``: ``store``, ``object_store``, ``cuda_ipc``
(``collective`` is in ``collective_transport.py``). Each is a ``moerl.weights.transport.WeightTransport``:
the driver builds it, ``publish`` asks the trainer for its weights (or buckets) and sends them to the
workers, and its ``receiver_spec`` travels to each worker, which opens its ``WeightSource`` from it.

Ray is imported inside functions (async mode only); the config sections are duck-typed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moerl.weights.buckets import (
    BucketAssembler,
    BucketPublisher,
    PublishReport,
    StreamedVersion,
    SyncStats,
    WeightBucket,
    bucket_bytes_of,
    pinned_host_buffer,
)
from moerl.weights.ipc import IpcPublisher, IpcReceiver
from moerl.weights.ipc_slots import IpcListener, connect
from moerl.weights.offer import OfferSink, WeightOffer
from moerl.weights.store import ChecksumError, WeightStore, pack_weights, unpack_weights

if TYPE_CHECKING:
    from moerl.config import RuntimeConfig

log = logging.getLogger(__name__)


def _ray():
    import ray  # lazy: Ray is an optional dependency, needed only in async mode

    return ray


def is_due(version: int, durable_every: int, durable: bool | None) -> bool:
    """Whether ``version`` goes to the durable store: ``durable`` if given, else every
    ``durable_every``-th version (``runtime.durable_every``)."""
    return version % durable_every == 0 if durable is None else durable


def write_durable(store: WeightStore, trainer) -> None:
    """The trainer's current version to ``store``, off the critical path: a one-process trainer (or a
    ``WeightSnapshot``) hands its tensors to the store's background writer, which takes a host snapshot
    now (``WeightStore.publish_in_background``); a trainer group (``num_ranks > 1``) writes through its
    own ``publish`` (rank 0 gathers the shards bucket by bucket: a collective, in the foreground).

    Raises:
        WeightWriteError: an earlier background write failed.
    """
    if getattr(trainer, "num_ranks", 1) > 1:
        trainer.publish(store)
    else:
        store.publish_in_background(trainer.version, trainer.named_weights())


def ensure_durable(store: WeightStore, trainer) -> None:
    """The trainer's current version is in ``store`` once this returns (background writes flushed; a
    version not written yet is published now): what a run's last version needs."""
    store.flush()
    if (latest := store.latest()) is None or latest.version < trainer.version:
        trainer.publish(store)


class OfferedWeights:
    """Whole versions offered through the object store (``offer``: a ref of ``PackedWeights``), falling
    back to ``fallback`` (polling the weight store); the ``store`` transport's worker side. An offer
    whose table and bytes fail their checksum is refused (logged, counted in ``stats.refused_versions``)
    and the fallback polled instead."""

    def __init__(self, fallback) -> None:
        self.fallback = fallback
        self.stats = SyncStats()
        self._offer: tuple[int, object] | None = None
        self._lock = threading.Lock()

    def receive(self, offer: WeightOffer) -> None:
        """A whole version offered through the ``store`` transport (``WeightOffer.ref``: ``PackedWeights``)."""
        self.offer(offer.version, offer.ref)

    def offer(self, version: int, ref) -> None:
        """Weights of ``version`` as an object ref of ``PackedWeights`` (replaces an unclaimed offer)."""
        with self._lock:
            self._offer = (version, ref)

    def poll(self, version: int):
        """The offered weights if newer than ``version``, else the fallback's newer version, else None."""
        with self._lock:
            offer, self._offer = self._offer, None
        if offer is not None and offer[0] > version:
            try:
                return offer[0], unpack_weights(_ray().get(offer[1]))
            except ChecksumError as e:
                log.error("weight version %d refused: %s", offer[0], e)
                self.stats.refused_versions += 1
        return None if self.fallback is None else self.fallback.poll(version)

    @property
    def refused_versions(self) -> int:
        """``stats.refused_versions``."""
        return self.stats.refused_versions

    def close(self) -> None:
        """Nothing runs in the background."""


class ObjectStoreSink:
    """A ``BucketSink`` for ``object_store``: ``ray.put`` each bucket (in the process that packed it) and
    offer its ref to every worker's ``OfferSink`` at once (picklable: travels to trainer rank 0)."""

    def __init__(self, workers: Sequence[OfferSink]) -> None:
        self.workers = list(workers)

    def send(self, bucket: WeightBucket):
        """Put ``bucket`` (a copy: its buffer may be reused) and offer it; returns its ref."""
        ref = _ray().put(bucket)
        offer = WeightOffer(bucket.version, ref, bucket.index, bucket.num_buckets)
        for worker in self.workers:
            worker(offer)
        return ref


@dataclass(frozen=True, slots=True)
class AssemblerSpec:
    """Worker side of ``object_store`` (and an EP follower's of ``store``): buckets offered by ref,
    fetched and checked on a thread (``BucketAssembler``)."""

    is_whole: bool = False
    """``store``: the worker's rank 0 takes whole offered versions (``OfferedWeights``) instead."""

    def for_worker(self, num_ranks: int) -> AssemblerSpec:
        """The same spec for every worker."""
        return self

    def open(self, *, fallback, device, rank: int = 0):
        """This rank's ``WeightSource`` (rank > 0: an EP follower, fed by its leader's forwarded offers)."""
        if self.is_whole and rank == 0:
            return OfferedWeights(fallback)
        stage = pinned_host_buffer if torch.device(device).type == "cuda" else None
        return BucketAssembler(_ray().get, fallback, stage=stage)


class StoreTransport:
    """``runtime.weight_sync=store``: every version written to the ``WeightStore`` and offered whole
    (``pack_weights`` + ``ray.put``); the serialize-and-load path, simplest and slowest."""

    name = "store"
    supports_ep_rollout = True
    sends_from_snapshot = False

    @staticmethod
    def check_config(runtime: RuntimeConfig, *, trainer_ranks: int, rollout_ep_size: int) -> None:
        """Every combination works."""

    def __init__(self, runtime: RuntimeConfig, store: WeightStore) -> None:
        self.store = store

    def publish(self, trainer, workers: Sequence, *, durable: bool | None = None) -> PublishReport:
        """Write the trainer's version (unless ``durable`` is False: already written) and offer it."""
        t0 = time.perf_counter()
        if durable is not False:
            trainer.publish(self.store)
        packed = pack_weights(trainer.named_weights())  # one flat buffer: fast out-of-band serialization
        ref = _ray().put(packed)
        for w in workers:  # followers poll the store: whole versions go to the leader only
            w(WeightOffer(trainer.version, ref, to_followers=False))
        nbytes = packed.data.nbytes
        return PublishReport(
            trainer.version, time.perf_counter() - t0, 1, nbytes, nbytes * len(workers), True
        )

    def offer_newest(self, worker) -> None:
        """A new worker loads the store's newest version itself."""

    def receiver_spec(self) -> AssemblerSpec:
        """Whole offered versions, else the store."""
        return AssemblerSpec(is_whole=True)

    def finish(self, trainer) -> None:
        """The last version in the store."""
        ensure_durable(self.store, trainer)

    def close(self) -> None:
        """Nothing to release."""


class ObjectStoreTransport:
    """``runtime.weight_sync=object_store``: each version in buckets of ``publish_bucket_mb``, one Ray
    object ref each, offered to every worker (EP followers get their leader's forwarded refs), put by
    the process that packs them (a trainer group's rank 0); the durable store written in the background
    every ``durable_every`` versions from the object store's copies (``moerl.weights.buckets``)."""

    name = "object_store"
    supports_ep_rollout = True
    sends_from_snapshot = True

    @staticmethod
    def check_config(runtime: RuntimeConfig, *, trainer_ranks: int, rollout_ep_size: int) -> None:
        """Every combination works."""

    def __init__(self, runtime: RuntimeConfig, store: WeightStore | None) -> None:
        ray = _ray()
        self.publisher = BucketPublisher(
            bucket_bytes_of(runtime.publish_bucket_mb),
            ray.put,
            ray.get,
            store,
            durable_every=runtime.durable_every,
        )

    def publish(self, trainer, workers: Sequence, *, durable: bool | None = None) -> PublishReport:
        """The trainer streams its buckets into the object store and offers each to ``workers``."""
        streamed = trainer.stream_buckets(ObjectStoreSink(workers), self.publisher.bucket_bytes)
        return self.publisher.adopt(streamed, len(workers), durable=durable)

    def offer_newest(self, worker) -> None:
        """Offer a (new) worker the newest streamed version's buckets: with ``durable_every > 1`` the
        store it loads at start may be older."""
        last = self.publisher.last
        if last is None:
            return
        for i, ref in enumerate(self.publisher.refs):
            worker(WeightOffer(last.version, ref, i, last.num_buckets))

    def receiver_spec(self) -> AssemblerSpec:
        """Buckets by ref, checked and assembled on a thread."""
        return AssemblerSpec()

    def finish(self, trainer) -> None:
        """The last version in the store."""
        ensure_durable(self.publisher.store, trainer)

    def close(self) -> None:
        """The refs go with the driver."""


@dataclass(frozen=True, slots=True)
class IpcSpec:
    """Worker side of ``cuda_ipc``: the trainer's listener address."""

    address: str
    """Unix socket of the trainer's ``IpcListener``."""
    authkey: bytes
    """Its authentication key."""

    def for_worker(self, num_ranks: int) -> IpcSpec:
        """The same spec for every worker."""
        return self

    def open(self, *, fallback, device, rank: int = 0) -> IpcReceiver:
        """Connect to the trainer's ring; received on a thread."""
        return IpcReceiver(connect(self.address, self.authkey), device, fallback=fallback, background=True)


class CudaIpcTransport:
    """``runtime.weight_sync=cuda_ipc`` (``moerl.weights.ipc``): for a trainer and workers on one host
    (hybrid / colocated engines): buckets through a ring of shared device buffers (CUDA IPC; shared
    memory on CPU), checksummed on the device; the durable store in the background (from a host
    snapshot) every ``durable_every`` versions."""

    name = "cuda_ipc"
    supports_ep_rollout = False
    sends_from_snapshot = False

    @staticmethod
    def check_config(runtime: RuntimeConfig, *, trainer_ranks: int, rollout_ep_size: int) -> None:
        """One trainer process, one-rank workers.

        Raises:
            ValueError: ``trainer_ranks > 1`` or ``rollout_ep_size > 1``.
        """
        if trainer_ranks > 1:
            raise ValueError(
                f"runtime.weight_sync=cuda_ipc needs one trainer process (trainer.num_ranks={trainer_ranks}); "
                "a trainer group streams its buckets with object_store or collective"
            )
        if rollout_ep_size > 1:
            raise ValueError(
                f"rollout.ep_size={rollout_ep_size} with runtime.weight_sync=cuda_ipc: an EP group's follower "
                "ranks receive weights through object_store, collective or the store"
            )

    def __init__(self, runtime: RuntimeConfig, store: WeightStore | None) -> None:
        self.store, self.durable_every = store, runtime.durable_every
        self.bucket_bytes = bucket_bytes_of(runtime.publish_bucket_mb)
        self.listener = (
            IpcListener()
        )  # workers on this host connect here; the ring is made at the first publish
        self.ipc: IpcPublisher | None = None

    def publish(self, trainer, workers: Sequence, *, durable: bool | None = None) -> PublishReport:
        """The version through the ring to every connected worker (new connections joined first); the
        store in the background when due (``write_durable``: from a host snapshot taken now)."""
        t0 = time.perf_counter()
        tensors: Mapping[str, torch.Tensor] = trainer.named_weights()
        if self.ipc is None:
            self.ipc = IpcPublisher(tensors, self.bucket_bytes)
        for conn in self.listener.take_new():
            self.ipc.connect(conn)
        report = self.ipc.publish(trainer.version, tensors)
        is_durable = self.store is not None and is_due(trainer.version, self.durable_every, durable)
        if is_durable:
            write_durable(self.store, trainer)
        seconds = time.perf_counter() - t0
        moved = report.nbytes * report.num_engines
        return PublishReport(trainer.version, seconds, 0, report.nbytes, moved, is_durable)

    def offer_newest(self, worker) -> None:
        """A new worker connects and gets the next version (the store's newest meanwhile)."""

    def receiver_spec(self) -> IpcSpec:
        """The listener's address."""
        return IpcSpec(self.listener.address, self.listener.authkey)

    def finish(self, trainer) -> None:
        """The last version in the store."""
        if self.store is not None:
            ensure_durable(self.store, trainer)

    def close(self) -> None:
        """Close the listener and the ring (the workers are gone: no acknowledgement is awaited)."""
        self.listener.close()
        if self.ipc is not None:
            self.ipc.engines = []
            self.ipc.ring.close()


def stream_named(version: int, named: Mapping[str, torch.Tensor], bucket_bytes: int, sink) -> StreamedVersion:
    """Pack ``named`` bucket by bucket into one reused staging buffer and hand each to ``sink.send``
    (which must consume it before it returns); the one-process trainer's ``stream_buckets``."""
    from moerl.weights.buckets import iter_packed

    t0, refs, nbytes = time.perf_counter(), [], 0
    for bucket in iter_packed(version, named, bucket_bytes, reuse=True):
        refs.append(sink.send(bucket))
        nbytes += bucket.nbytes
    return StreamedVersion(version, tuple(refs), nbytes, time.perf_counter() - t0)
