"""Weight sync through shared device buffers (``runtime.weight_sync=cuda_ipc``): for a trainer and
rollout engines that share a GPU, as hybrid / colocated RL engines do.

    trainer (IpcPublisher):  a ring of ``num_slots`` flat device buffers of the largest bucket, allocated
                             once; their IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
                             go to each engine once, when it connects. Per bucket: wait until every
                             engine has acknowledged the bucket the slot held before, pack the bucket's
                             tensors into the slot (device-to-device copies), checksum it on the device,
                             send (version, index, num_buckets, slot, layout, checksum).
    engine (IpcReceiver):    a ``WeightSource``: ``poll`` (between scheduler steps) sees the first bucket
                             of a newer version and takes the whole version there and then: each bucket
                             is copied out of the mapped slot into the engine's own receive buffer (one
                             per bucket, allocated once), its checksum is checked, and the bucket is
                             acknowledged (the trainer may refill the slot); once all have arrived the
                             version's tensors (views of the receive buffers) go to
                             ``Engine.update_weights``. An unfinished or corrupt version is dropped (the
                             engine's weights stay whole) and ``fallback`` (the store) is polled.

Nothing crosses a process boundary but the handles and small control messages
(``multiprocessing.connection``: a ``Pipe`` end, or ``Listener``/``Client`` between unrelated
processes); the bytes move GPU to GPU memory inside the one device. On CPU the same code shares the
ring through shared memory (``reduce_tensor`` of a shared CPU tensor), which is how it is tested.

Checksum: the sum of the bucket's bytes read as int64 words, wrapping modulo 2**64 (``_checksum_no_sync``
on the device, one sync for ``.item()``). Summation order does not change a wrapping integer sum, so the
trainer and the engine agree exactly. It catches a bucket that is truncated, stale (the slot refilled
before the engine copied it), from another version or partly written; it is not a cryptographic hash.
xxh3 (the object-store path's) would need every bucket on the host: a device-to-host copy plus the hash
of 13.8 GB on the CPU, seconds per version (``bench/weight_sync.py`` measures it), more than the sync.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import reduce_tensor

from moerl.runtime.weight_sync import split_buckets

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor of a slot starts at a multiple of this (int64 words for the checksum)


class IpcSyncError(RuntimeError):
    """A shared-buffer bucket did not arrive whole: timeout, closed connection, or checksum mismatch."""


def _checksum_no_sync(data: torch.Tensor) -> torch.Tensor:
    """0-dim int64 tensor: sum of ``data`` ([n] uint8, n a multiple of 8) as int64 words, wrapping."""
    return data.view(torch.int64).sum()


def tensors_checksum_no_sync(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim int64 tensor: ``_checksum_no_sync`` of the slot these tensors are packed into (each at a multiple of 64 bytes,
    zero padding), computed on the tensors' own device without packing them: the word sums of each
    tensor's bytes, a last partial word zero-padded."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        if whole:
            total += raw[:whole].view(torch.int64).sum()
        if whole < raw.numel():
            tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
            tail[: raw.numel() - whole] = raw[whole:]
            total += tail.view(torch.int64)[0]
    return total


def _pin_no_sync(t: torch.Tensor) -> bool:
    """Page-lock a shared CPU tensor's memory in this process (``cudaHostRegister``), so that copies
    between it and the GPU run at full speed and asynchronously; False where that failed."""
    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except (AttributeError, RuntimeError) as e:  # a torch build without the binding: stay pageable
        log.warning("cudaHostRegister unavailable (%s): host slots stay pageable", e)
        return False
    return int(err) == 0


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a bucket's tensors sit in its slot: (name, dtype, shape, byte offset), total bytes."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    nbytes: int


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> _Layout:
    entries, offset = [], 0
    for name, t in tensors:
        entries.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return _Layout(tuple(entries), offset)


@dataclass(frozen=True, slots=True)
class IpcReport:
    """Trainer-side figures of one shared-buffer publish."""

    version: int
    """The version sent."""
    seconds: float
    """Wall seconds from the first bucket's pack to the last bucket's send (acks of the last
    ``num_slots`` buckets may still be outstanding)."""
    num_buckets: int
    """Buckets of the version."""
    nbytes: int
    """Bytes of the version's buckets."""
    num_engines: int
    """Engines it was sent to."""


class IpcPublisher:
    """Trainer side of ``runtime.weight_sync=cuda_ipc`` (module docstring).

    Args:
        template: the named tensors every version has (names, shapes, dtypes, device); the bucket plan
            and the ring are made from it once.
        bucket_bytes: bucket size (``bucket_bytes_of(runtime.publish_bucket_mb)``).
        num_slots: buffers in the ring (2: the trainer packs one bucket while engines copy the other).
        timeout_s: longest wait for an engine's acknowledgement; an engine that is later is dropped.
        slot_device: where the ring lives; None: the tensors' device (CUDA IPC on a GPU). ``"cpu"`` with
            CUDA tensors: shared host memory, page-locked in both processes (the pinned-host variant:
            device-to-host into the slot, host-to-device out of it).

    Raises:
        ValueError: no tensors, tensors on several devices, ``num_slots`` < 1.
    """

    def __init__(
        self,
        template: Mapping[str, torch.Tensor],
        bucket_bytes: int,
        *,
        num_slots: int = 2,
        timeout_s: float = 60.0,
        slot_device: torch.device | str | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"IpcPublisher: num_slots={num_slots} must be >= 1")
        devices = {t.device for t in template.values()}
        if len(devices) != 1:
            raise ValueError(f"IpcPublisher: tensors on {len(devices)} devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.plan = [[n for n, _ in b] for b in split_buckets(template, bucket_bytes)]
        self.shapes = {n: (t.dtype, tuple(t.shape)) for n, t in template.items()}
        self.layouts = [_layout([(n, template[n]) for n in names]) for names in self.plan]
        slot_bytes = max(x.nbytes for x in self.layouts)
        self.slots = [
            torch.zeros(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)
        ]
        if self.device.type == "cpu":
            for s in self.slots:
                s.share_memory_()  # before reduce_tensor, which would otherwise move (copy) it there
        self.timeout_s = timeout_s
        self.engines: list = []
        """Connections of the engines (``multiprocessing.connection.Connection``)."""
        self._waiting: list[set[int]] = [set() for _ in self.slots]  # engine ids yet to ack each slot
        self._ids: dict[int, object] = {}
        self.last: IpcReport | None = None

    def connect(self, conn) -> None:
        """Add an engine: send it the ring's IPC handles (``reduce_tensor``: for CUDA a ``cudaIpc`` memory
        handle, for CPU a shared-memory file descriptor; both travel pickled through ``conn``)."""
        conn.send(("slots", [reduce_tensor(s) for s in self.slots]))
        self._ids[id(conn)] = conn
        self.engines.append(conn)

    def publish(self, version: int, named: Mapping[str, torch.Tensor]) -> IpcReport:
        """Send ``named`` as ``version`` to every connected engine, bucket by bucket (module docstring).

        Raises:
            ValueError: ``named`` differs from the template in names, shapes or dtypes.
        """
        got = {n: (t.dtype, tuple(t.shape)) for n, t in named.items()}
        if got != self.shapes:
            raise ValueError(
                "IpcPublisher.publish: tensors differ from the template (names, shapes or dtypes)"
            )
        t0 = time.perf_counter()
        n = len(self.plan)
        for index, names in enumerate(self.plan):
            slot_id = index % len(self.slots)
            self._await_acks(slot_id)
            layout = self.layouts[index]
            slot = self.slots[slot_id][: layout.nbytes]
            slot.zero_()  # the alignment padding is summed too
            for (_, _, _, start), name in zip(layout.entries, names, strict=True):
                raw = named[name].detach().contiguous().reshape(-1).view(torch.uint8)
                slot[start : start + raw.numel()].copy_(raw)
            checksum = int(
                _checksum_no_sync(slot)
            )  # the one device sync: the slot is written before the send
            message = ("bucket", version, index, n, slot_id, layout.entries, layout.nbytes, checksum)
            for conn in list(self.engines):
                try:
                    conn.send(message)
                    self._waiting[slot_id].add(id(conn))
                except OSError:
                    self._drop(conn, "its connection closed")
        self.last = IpcReport(
            version, time.perf_counter() - t0, n, sum(x.nbytes for x in self.layouts), len(self.engines)
        )
        return self.last

    def _await_acks(self, slot_id: int) -> None:
        """Block until every engine has acknowledged the bucket in ``slot_id`` (acks of other slots
        that arrive meanwhile are recorded); drop engines that stay silent past ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while self._waiting[slot_id]:
            conn = self._ids[next(iter(self._waiting[slot_id]))]
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self._drop(conn, f"no acknowledgement within {self.timeout_s:.0f} s")
                    continue
                kind, acked_slot = conn.recv()
            except (EOFError, OSError):
                self._drop(conn, "its connection closed")
                continue
            if kind == "ack":
                self._waiting[acked_slot].discard(id(conn))

    def _drop(self, conn, why: str) -> None:
        log.error("weight-sync engine dropped: %s", why)
        self.engines = [c for c in self.engines if c is not conn]
        for waiting in self._waiting:
            waiting.discard(id(conn))
        self._ids.pop(id(conn), None)
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        """Wait for the outstanding acknowledgements, then close every engine connection."""
        for slot_id in range(len(self.slots)):
            self._await_acks(slot_id)
        for conn in list(self.engines):
            conn.close()
        self.engines = []


@dataclass(slots=True)
class IpcStats:
    """Engine-side figures (cumulative unless said otherwise)."""

    versions_applied: int = 0
    """Complete versions handed to the engine."""
    versions_dropped: int = 0
    """Versions given up (a bucket late, corrupt or lost)."""
    last_sync_s: float | None = None
    """Seconds from the first bucket's arrival to the version's hand-off, last applied version."""
    last_bytes: int = 0
    """Bytes of the last applied version."""


class IpcReceiver:
    """Engine side of ``runtime.weight_sync=cuda_ipc``; a ``WeightSource`` (module docstring).

    Args:
        conn: the connection to the ``IpcPublisher`` (which ``connect``ed its other end).
        device: where the receive buffers live (the engine's device; the slots' device on CUDA).
        fallback: a ``WeightSource`` polled when no newer version arrives whole (the store).
        timeout_s: longest wait for the next bucket of a version once its first one has arrived.
    """

    def __init__(self, conn, device: torch.device | str, fallback=None, *, timeout_s: float = 60.0) -> None:
        self.conn, self.device, self.fallback, self.timeout_s = (
            conn,
            torch.device(device),
            fallback,
            timeout_s,
        )
        self.stats = IpcStats()
        self.slots: list[torch.Tensor] | None = None
        self.buffers: dict[int, torch.Tensor] = {}  # bucket index -> receive buffer, reused across versions
        self._pending: tuple | None = None  # a bucket message read while looking for the next version
        self.is_pinned = False  # host slots page-locked here (the pinned-host variant)

    def poll(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version newer than ``version`` that has arrived whole, taken now (blocks while the
        rest of a started version arrives); its tensors are views of this receiver's buffers, valid until
        the next ``poll``. Else ``fallback.poll(version)``, else None."""
        got = None
        while (message := self._next(block=False)) is not None:
            if message[1] <= version or message[2] != 0:
                self._ack(message[4])
                continue  # an old version, or the tail of a dropped one
            try:
                got = self._take_version(message)
            except IpcSyncError as e:
                log.error("weight version %d dropped: %s", message[1], e)
                self.stats.versions_dropped += 1
                if isinstance(e.__cause__, (EOFError, OSError)):
                    break
        if got is not None:
            return got
        return None if self.fallback is None else self.fallback.poll(version)

    def _take_version(self, first: tuple) -> tuple[int, dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        _, version, _, num_buckets, *_ = first
        tensors, nbytes, message = {}, 0, first
        for index in range(num_buckets):
            if index > 0:
                message = self._next(block=True)
            _, v, i, n, slot_id, entries, size, checksum = message
            if (v, i, n) != (version, index, num_buckets):
                self._pending = message  # a newer version started: this one will never be whole
                raise IpcSyncError(
                    f"bucket {index}/{num_buckets} of version {version} replaced by {i} of {v}"
                )
            buf = self.buffers.get(index)
            if buf is None or buf.numel() != size:
                buf = self.buffers[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
            buf.copy_(self.slots[slot_id][:size], non_blocking=self.is_pinned)
            got = int(_checksum_no_sync(buf))  # device sync: the copy is done before the ack
            self._ack(slot_id)
            if got != checksum:
                raise IpcSyncError(
                    f"bucket {index + 1}/{num_buckets} of version {version}: checksum {got} != {checksum}"
                )
            nbytes += size
            for name, dtype, shape, start in entries:
                length = math.prod(shape) * dtype.itemsize
                tensors[name] = buf[start : start + length].view(dtype).view(shape)
        s = self.stats
        s.versions_applied += 1
        s.last_sync_s, s.last_bytes = time.perf_counter() - t0, nbytes
        return version, tensors

    def _next(self, *, block: bool) -> tuple | None:
        """The next bucket message (the slot handles are mapped on the way); None if none is waiting.

        Raises:
            IpcSyncError: ``block`` and nothing came within ``timeout_s``, or the trainer is gone.
        """
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message
        while True:
            try:
                if not self.conn.poll(self.timeout_s if block else 0):
                    if block:
                        raise IpcSyncError(f"no bucket within {self.timeout_s:.0f} s")
                    return None
                message = self.conn.recv()
            except (EOFError, OSError) as e:
                if not block:
                    return None
                raise IpcSyncError("the trainer's connection closed") from e
            if message[0] == "slots":  # rebuild the tensors from their IPC handles: mapped once
                self.slots = [fn(*args) for fn, args in message[1]]
                if self.device.type == "cuda" and self.slots[0].device.type == "cpu":
                    self.is_pinned = all([_pin_no_sync(s) for s in self.slots])
                continue
            return message

    def _ack(self, slot_id: int) -> None:
        try:
            self.conn.send(("ack", slot_id))
        except OSError:
            pass  # the trainer is gone; the next _next says so
