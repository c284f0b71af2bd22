"""Weight sync in buckets: the trainer streams a version to the rollout workers bucket by bucket.

    trainer: named tensors --split_buckets--> [bucket 0 | bucket 1 | ... ]   (about publish_bucket_mb each)
             each bucket: pack_bucket (one flat uint8 buffer + xxh3-64 checksum) -> ray.put -> a WeightOffer to each OfferSink
    worker:  BucketAssembler: fetch thread resolves each ref, checks version/index/checksum; the version
             becomes pollable only when all num_buckets buckets have arrived; the worker switches to it
             between scheduler steps (``RolloutWorker.sync_weights``).
    store:   every ``runtime.durable_every`` versions the same buckets go to the ``WeightStore`` on its
             background writer thread (manifest last), from the buffers already packed: the store stays
             the source of truth for recovery and for workers started later.

Nothing holds a second whole-model copy on the trainer side: a bucket is packed, put into the object
store and dropped before the next one is packed (the durable write reads the object store's copy back
without copying it). A worker holds the buckets of one incoming version (zero-copy views of the object
store's memory) until it switches; a newer version's first bucket replaces an unfinished older one.

The checksum is xxHash3-64 (https://github.com/Cyan4973/xxHash) of the bucket's (name, dtype, shape,
offset) table and bytes: it catches a bucket that was truncated, mixed up with another version's or
corrupted, a table that no longer describes its bytes, at several GB/s per core;
the store keeps its own sha256 per file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from moerl.weights.offer import OfferSink, WeightOffer
from moerl.weights.store import ChecksumError, table_digest

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor of a bucket starts at a multiple of this


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """One bucket of one policy version: consecutive tensors (in name order) in one flat byte buffer."""

    version: int
    """Policy version the bucket belongs to."""
    index: int
    """0-based bucket index within the version."""
    num_buckets: int
    """Buckets of the version; the version is complete when all of them have arrived."""
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    """(name, dtype, shape, byte offset in ``data``) of each tensor."""
    checksum: str
    """xxh3-64 hex digest of the entry table and ``data`` (``bucket_digest``)."""
    data: np.ndarray
    """[nbytes] uint8: the tensors' bytes, each at a multiple of 64."""

    @property
    def nbytes(self) -> int:
        """Bytes of ``data``."""
        return int(self.data.nbytes)


def bucket_digest(entries, data: np.ndarray) -> str:
    """xxh3-64 hex digest of a bucket: its (name, dtype, shape, offset) table, then its bytes, so that a
    table damaged or mixed up in transit (a wrong shape or dtype over the right bytes) fails it too
    (``moerl.weights.store.table_digest``)."""
    return table_digest(entries, data)


def bucket_bytes_of(publish_bucket_mb: float) -> int:
    """``runtime.publish_bucket_mb`` in bytes (MiB, at least one byte)."""
    return max(1, int(publish_bucket_mb * 2**20))


def split_buckets(
    named: Mapping[str, torch.Tensor], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Tensors in name order, cut into consecutive buckets of at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own).

    Raises:
        ValueError: no tensors, or ``bucket_bytes`` < 1.
    """
    if not named or bucket_bytes < 1:
        raise ValueError(f"split_buckets: {len(named)} tensors, bucket_bytes={bucket_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name in sorted(named):
        t = named[name]
        num_bytes = t.numel() * t.element_size()
        if buckets[-1] and size + num_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += num_bytes
    return buckets


def packed_nbytes(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> int:
    """Bytes of ``named`` packed in buckets of ``bucket_bytes`` (each tensor padded to 64 bytes, as
    ``pack_bucket`` lays them out): what each worker fetches of the version, known before it is packed.

    Raises:
        ValueError: as ``split_buckets``.
    """
    return sum(
        -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        for bucket in split_buckets(named, bucket_bytes)
        for _, t in bucket
    )


def pack_bucket(
    version: int,
    index: int,
    num_buckets: int,
    tensors: list[tuple[str, torch.Tensor]],
    staging: torch.Tensor | None = None,
) -> WeightBucket:
    """Copy ``tensors`` (any device and dtype) into one flat CPU buffer with its checksum.

    Args:
        staging: a [>= nbytes] uint8 CPU buffer to pack into (reused across buckets by a publisher whose
            ``put`` copies; pinned on CUDA); None: a new buffer. The bucket's ``data`` is a view of it.

    On CUDA the copies go through pinned memory and one synchronize at the end (the only device sync).
    """
    entries, offset = [], 0
    for name, t in tensors:
        entries.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    on_cuda = any(t.is_cuda for _, t in tensors)
    if staging is not None and staging.numel() >= offset:
        data = staging[:offset]
    else:
        data = torch.empty(offset, dtype=torch.uint8, pin_memory=on_cuda)
    data.zero_()  # the alignment padding is hashed too
    for (_, _, _, start), (_, t) in zip(entries, tensors, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        data[start : start + raw.numel()].copy_(raw, non_blocking=on_cuda)
    if on_cuda:
        torch.cuda.synchronize()  # the non-blocking copies must land before the bytes are hashed
    array = data.numpy()
    entries = tuple(entries)
    return WeightBucket(version, index, num_buckets, entries, bucket_digest(entries, array), array)


def unpack_bucket(bucket: WeightBucket, *, verify: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as CPU views of its buffer (no copy; read-only when the buffer is the
    object store's, so copy them into parameters, never write them).

    Raises:
        ChecksumError: ``verify`` and the table and bytes do not match the bucket's checksum.
    """
    if verify:
        digest = bucket_digest(bucket.entries, bucket.data)
        if digest != bucket.checksum:
            raise ChecksumError(
                f"weight bucket {bucket.index + 1}/{bucket.num_buckets} of version {bucket.version}: "
                f"xxh3 {digest} does not match {bucket.checksum}"
            )
    with warnings.catch_warnings():  # the object store hands out read-only arrays; we only read them
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(bucket.data)
    out = []
    for name, dtype, shape, start in bucket.entries:
        size = math.prod(shape) * dtype.itemsize
        out.append((name, data[start : start + size].view(dtype).view(shape)))
    return out


class BucketPacker:
    """``pack_bucket`` into one staging buffer grown to the largest bucket so far and reused: each bucket
    must be consumed (copied, e.g. by ``ray.put``) before the next one is packed."""

    def __init__(self) -> None:
        self.staging: torch.Tensor | None = None

    def pack(
        self, version: int, index: int, num_buckets: int, tensors: list[tuple[str, torch.Tensor]]
    ) -> WeightBucket:
        """``pack_bucket`` of ``tensors`` into the staging buffer (a view of it)."""
        bucket = pack_bucket(version, index, num_buckets, tensors, self.staging)
        if self.staging is None or self.staging.numel() < bucket.nbytes:
            self.staging = torch.from_numpy(bucket.data)
        return bucket


def iter_packed(
    version: int, named: Mapping[str, torch.Tensor], bucket_bytes: int, *, reuse: bool = False
) -> Iterable[WeightBucket]:
    """``pack_bucket`` of each of ``split_buckets``, one at a time. ``reuse``: every bucket is packed
    into the same staging buffer (``BucketPacker``), so each must be consumed before the next is taken."""
    plan = split_buckets(named, bucket_bytes)
    packer = BucketPacker()
    for i, tensors in enumerate(plan):
        yield (
            packer.pack(version, i, len(plan), tensors)
            if reuse
            else pack_bucket(version, i, len(plan), tensors)
        )


@dataclass(frozen=True, slots=True)
class StreamedVersion:
    """A version whose buckets were packed and sent where the weights live (``stream_buckets``)."""

    version: int
    """The version sent."""
    refs: tuple
    """What the sink returned for each bucket, in index order: object refs (owned by the process that put
    them) with ``object_store``, None with ``collective``."""
    nbytes: int
    """Bucket bytes of the version (what each worker fetches)."""
    seconds: float
    """Wall seconds from the first bucket's gather to the last bucket's offer."""


@dataclass(slots=True)
class SyncStats:
    """Worker-side figures of the weight sync (cumulative unless said otherwise)."""

    versions_applied: int = 0
    """Complete versions handed to the engine."""
    bytes_received: int = 0
    """Bucket bytes fetched."""
    last_sync_s: float | None = None
    """Seconds from the first bucket's offer of the last applied version to its hand-off to the engine."""
    last_bytes: int = 0
    """Bytes of the last applied version."""
    dropped_versions: int = 0
    """Versions given up unfinished because a newer one started arriving."""
    refused_buckets: int = 0
    """Buckets refused on arrival (checksum mismatch, or not of the version/index they came as); their
    version is never switched to."""
    refused_versions: int = 0
    """Versions refused: one of their buckets refused (``refused_buckets``), or, with the ``store``
    transport, a whole offer whose table and bytes failed their checksum."""


def pinned_host_buffer(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 page-locked host memory (``BucketAssembler``'s ``stage`` on a GPU worker).

    Raises:
        RuntimeError: no CUDA device to pin memory for (torch's error).
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(slots=True)
class _Incoming:
    version: int
    num_buckets: int
    first_offer: float
    buckets: dict[int, WeightBucket] = field(default_factory=dict)


class BucketAssembler:
    """Worker side of the bucketed sync; a ``WeightSource`` (``poll``) fed by ``offer``.

    Args:
        resolve: bucket reference -> ``WeightBucket`` (``ray.get`` in an actor; identity in tests).
        fallback: a ``WeightSource`` polled when no complete offered version is newer (the store).
        background: resolve offers on a fetch thread (True in actors) or inside ``offer`` (tests).

        stage: ``nbytes -> uint8 host tensor``: each checked bucket is copied (on the fetch thread) into a
            buffer of its index made by ``stage`` once and reused, and ``poll`` hands out views of those.
            On a GPU worker ``pinned_host_buffer``: the engine's copy to the device between scheduler
            steps then runs from page-locked memory at DMA speed, not through the object store's pageable
            pages (the copy out of those is done on the fetch thread, while the engine generates).
            ``None``: views of the fetched buffers themselves.

    Offers of one version may come in any order and from another thread. A bucket that fails its checksum
    or does not belong to its version is dropped with an error log, and so is its version (the store's
    copy is then picked up by ``fallback``). With ``stage``, the one set of staging buffers is never
    written while the engine holds it (from the ``poll`` that handed it out to the next ``poll``: the
    fetch thread waits), and a complete version not yet taken is dropped when a newer one starts
    arriving (its buffers are about to be overwritten; the newer version supersedes it anyway).
    """

    def __init__(
        self,
        resolve: Callable[[object], WeightBucket],
        fallback=None,
        *,
        background: bool = True,
        stage: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.resolve = resolve
        self.fallback = fallback
        self.stats = SyncStats()
        self._lock = threading.Lock()
        self._incoming: _Incoming | None = None
        self._complete: _Incoming | None = None
        self._bad_versions: set[int] = set()
        self._stage = stage
        self._staged: dict[int, torch.Tensor] = {}  # bucket index -> staging buffer (``stage``)
        self._held = False  # the engine holds views of the staging buffers (handed out, not yet re-polled)
        self._closed = False
        self._released = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue | None = None
        if background:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._fetch_loop, name="moerl-weight-fetch", daemon=True).start()

    def receive(self, offer: WeightOffer) -> None:
        """A bucket offered through a transport (``WeightOffer``: version, index, buckets, ref)."""
        self.offer(offer.version, offer.index, offer.num_buckets, offer.ref)

    def offer(self, version: int, index: int, num_buckets: int, ref) -> None:
        """Bucket ``index`` of ``num_buckets`` of ``version`` is at ``ref`` (fetched now or by the thread)."""
        now = time.perf_counter()
        if self._queue is not None:
            self._queue.put((version, index, num_buckets, ref, now))
        else:
            self._receive(version, index, num_buckets, ref, now)

    @property
    def refused_versions(self) -> int:
        """``stats.refused_versions``."""
        return self.stats.refused_versions

    def close(self) -> None:
        """Stop the fetch thread (one waiting for the staging buffers gives up)."""
        with self._lock:
            self._closed = True
            self._released.notify_all()
        if self._queue is not None:
            self._queue.put(None)

    def _fetch_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._receive(*item)
            except Exception as e:  # a lost object, a dead trainer: this version is not applied
                # one line, no traceback: a worker back from a partition finds the versions it missed freed
                # by their owner (Ray's ReferenceCountingAssertionError), an expected end of those offers
                first = (str(e).strip().splitlines() or [""])[0][:300]
                log.warning(
                    "weight bucket %d of version %d could not be fetched (%s: %s); the version is skipped",
                    item[1], item[0], type(e).__name__, first,
                )  # fmt: skip
                self._bad_versions.add(item[0])

    def _receive(self, version: int, index: int, num_buckets: int, ref, offered_at: float) -> None:
        with self._lock:
            cur = self._incoming
            newest = max((x.version for x in (cur, self._complete) if x is not None), default=-1)
            if version < newest or version in self._bad_versions:
                return  # superseded while queued
            if cur is None or cur.version != version:
                if cur is not None:
                    self.stats.dropped_versions += 1
                cur = self._incoming = _Incoming(version, num_buckets, offered_at)
        bucket = self.resolve(ref)
        problem = None
        if (bucket.version, bucket.index, bucket.num_buckets) != (version, index, num_buckets):
            problem = f"is bucket {bucket.index}/{bucket.num_buckets} of version {bucket.version}"
        else:
            try:
                unpack_bucket(bucket, verify=True)
            except ChecksumError as e:
                problem = str(e)
        if problem is None and self._stage is not None:
            bucket = self._staged_copy(bucket, cur)
            if bucket is None:
                return  # superseded while it waited
        with self._lock:
            if problem is not None:
                log.error("weight bucket %d of version %d dropped: %s", index, version, problem)
                self.stats.refused_buckets += 1
                if version not in self._bad_versions:
                    self.stats.refused_versions += 1
                self._bad_versions.add(version)
                if self._incoming is cur:
                    self._incoming = None
                return
            if self._incoming is not cur:
                return
            cur.buckets[index] = bucket
            self.stats.bytes_received += bucket.nbytes
            if len(cur.buckets) == cur.num_buckets:
                self._complete, self._incoming = cur, None

    def _staged_copy(self, bucket: WeightBucket, cur: _Incoming) -> WeightBucket | None:
        """``bucket`` with its bytes copied into its index's staging buffer, once the engine holds none of
        them; None if ``cur`` was superseded meanwhile. A complete version not yet taken is dropped first
        (this copy overwrites its buffers)."""
        with self._lock:
            while self._held and not self._closed:
                self._released.wait()
            if self._incoming is not cur or self._closed:
                return None
            if self._complete is not None:
                self._complete = None
                self.stats.dropped_versions += 1
            buf = self._staged.get(bucket.index)
        n = bucket.data.nbytes
        if buf is None or buf.numel() < n:
            try:
                buf = self._staged[bucket.index] = self._stage(n)
            except RuntimeError as e:  # e.g. page-locked memory refused: views of the fetched bytes then
                log.warning("weight staging buffers unavailable (%s); using the fetched buffers", e)
                self._stage = None
                return bucket
        with warnings.catch_warnings():  # the object store's arrays are read-only; this only reads them
            warnings.simplefilter("ignore", UserWarning)
            buf[:n].copy_(torch.from_numpy(bucket.data))
        return dataclasses.replace(bucket, data=buf[:n].numpy())

    def poll(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest complete offered version if it is newer than ``version`` (views, to be copied into
        the engine's parameters before the next ``poll``), else ``fallback.poll(version)``, else None."""
        with self._lock:
            done, self._complete = self._complete, None
            self._held = False  # the engine copied what the last poll handed out
            if done is not None and done.version > version and self._stage is not None:
                self._held = True
            self._released.notify_all()
        if done is not None and done.version > version:
            tensors = {}
            for i in range(done.num_buckets):
                tensors.update(unpack_bucket(done.buckets[i], verify=False))  # verified on arrival
            s = self.stats
            s.versions_applied += 1
            s.last_sync_s = time.perf_counter() - done.first_offer
            s.last_bytes = sum(b.nbytes for b in done.buckets.values())
            return done.version, tensors
        return None if self.fallback is None else self.fallback.poll(version)


@dataclass(frozen=True, slots=True)
class PublishReport:
    """Trainer-side figures of one bucketed publish."""

    version: int
    """The version sent."""
    seconds: float
    """Wall seconds from the first bucket's pack to the last bucket's offer (``timing/weight_sync_s``)."""
    num_buckets: int
    """Buckets of the version."""
    bytes_per_worker: int
    """Bucket bytes each worker fetches."""
    bytes_moved: int
    """``bytes_per_worker`` times the workers offered to (``weights/sync_bytes``)."""
    durable: bool
    """The version also went to the weight store (in the background)."""


class BucketPublisher:
    """Trainer side of the bucketed sync: pack, put and offer one bucket at a time.

    Args:
        bucket_bytes: bucket size (``bucket_bytes_of(runtime.publish_bucket_mb)``).
        put: ``WeightBucket -> ref`` (``ray.put``); must copy the bucket's bytes (its buffer is reused).
        get: ``ref -> WeightBucket`` (``ray.get``: a zero-copy view of the object store's copy), used to
            hand the durable write the buffers already packed.
        store: the durable ``WeightStore``, or None.
        durable_every: versions that are multiples of this also go to ``store`` (``runtime.durable_every``).

    The refs of the newest version are kept until the next publish, so that its objects stay in the
    object store while workers fetch them.
    """

    def __init__(self, bucket_bytes: int, put, get, store=None, *, durable_every: int = 1) -> None:
        if durable_every < 1:
            raise ValueError(f"BucketPublisher: durable_every={durable_every} must be >= 1")
        self.bucket_bytes = bucket_bytes
        self.put, self.get = put, get
        self.store = store
        self.durable_every = durable_every
        self.refs: list = []
        """Refs of the newest version's buckets, in index order."""
        self.last: PublishReport | None = None

    def publish(
        self,
        version: int,
        named: Mapping[str, torch.Tensor],
        offers: Sequence[OfferSink],
        *,
        durable: bool | None = None,
    ) -> PublishReport:
        """Send ``named`` as ``version``: each bucket is packed, put, and offered (a ``WeightOffer``) to
        every sink of ``offers`` before the next bucket is packed.

        Args:
            durable: also write the version to the store; None: when ``version % durable_every == 0``.
        """
        t0 = time.perf_counter()
        refs, nbytes = [], 0
        for bucket in iter_packed(version, named, self.bucket_bytes, reuse=True):
            ref = self.put(bucket)  # copies (ray.put): the staging buffer is reused for the next bucket
            for sink in offers:
                sink(WeightOffer(version, ref, bucket.index, bucket.num_buckets))
            refs.append(ref)
            nbytes += bucket.nbytes
            del bucket  # the object store holds it now
        streamed = StreamedVersion(version, tuple(refs), nbytes, time.perf_counter() - t0)
        return self.adopt(streamed, len(offers), durable=durable)

    def adopt(
        self, streamed: StreamedVersion, num_offers: int, *, durable: bool | None = None
    ) -> PublishReport:
        """Take ``streamed`` (put and offered elsewhere, or by ``publish``) as the newest version: keep its
        refs, and write it to the store in the background when durable (``publish``'s ``durable``)."""
        self.refs = list(streamed.refs)
        version = streamed.version
        is_durable = self.store is not None and (
            version % self.durable_every == 0 if durable is None else durable
        )
        if is_durable:
            self.write_durable(version)
        self.last = PublishReport(
            version,
            streamed.seconds,
            len(self.refs),
            streamed.nbytes,
            streamed.nbytes * num_offers,
            is_durable,
        )
        return self.last

    def write_durable(self, version: int) -> None:
        """Write the newest version's buckets to the store on its background writer thread (one file
        per bucket, manifest last), from the object store's copies (no new copy is taken here)."""
        tensors: dict[str, torch.Tensor] = {}
        for ref in self.refs:
            tensors.update(unpack_bucket(self.get(ref), verify=False))
        self.store.publish_in_background(version, tensors, max_shard_bytes=self.bucket_bytes, copy=False)
