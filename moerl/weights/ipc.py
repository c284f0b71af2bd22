"""Weight sync through shared buffers (``runtime.weight_sync=cuda_ipc``): for a trainer and rollout
engines that share a GPU, as hybrid / colocated RL engines do.

    trainer (IpcPublisher):  a ring of ``num_slots`` flat buffers of the largest bucket, allocated once
                             (``ipc_slots.Slots``: device memory; host shared memory for the pinned-host
                             variant and on CPU); their handles (CUDA: ``reduce_tensor``'s IPC handle) go
                             to each engine once, when it connects. Per bucket: wait until every engine
                             has acknowledged the bucket the slot held before, checksum the bucket's
                             tensors on their device, copy them into the slot, send (version, index,
                             num_buckets, slot, layout, checksum).
    engine (IpcReceiver):    a ``WeightSource``. Each bucket is copied out of the mapped slot into the
                             engine's own receive buffer (one per bucket, allocated once), its checksum is
                             checked, and the bucket is acknowledged (the trainer may refill the slot);
                             once all buckets of the version have arrived its tensors (views of the
                             receive buffers) go to ``Engine.update_weights`` between scheduler steps. An
                             unfinished or corrupt version is dropped (the engine's weights stay whole)
                             and ``fallback`` (the store) is polled. ``background=False``: ``poll`` takes
                             a started version whole there and then (one set of receive buffers; the
                             bench). ``background=True``: a thread receives and acknowledges at once, so a
                             busy worker never holds the trainer up, into two sets of receive buffers
                             (one may be in the engine's hands while the other fills): the rollout workers.

Nothing crosses a process boundary but the handles and small control messages
(``multiprocessing.connection``: a ``Pipe`` end, or ``ipc_slots.IpcListener`` for processes started by
others); on a GPU the bytes move device to device inside the one GPU. On CPU the same code shares the
ring through named shared memory, which is how it is tested.

Checksum: the sum of the bucket's bytes read as int64 words, wrapping modulo 2**64, on the device (one
sync for ``.item()``): the trainer's over the source tensors, the engine's over its received copy.
Summation order does not change a wrapping integer sum, so both agree exactly. The xxh3-64 of the
bucket's (name, dtype, shape, offset) table is added to it (``table_word``), so a table that no longer
describes its bytes (two names swapped, a dtype or shape changed, an entry dropped) fails it too. It
catches a bucket that is truncated, stale (the slot refilled before the engine copied it), from another
version or partly written; it is not a cryptographic hash. xxh3 (the object-store path's) would need every bucket on the
host: for the 13.8 GB reference model a pinned device-to-host copy (0.25 s on an H200) plus hashing on
the CPU (xxh3 runs at about 17 GB/s on one core: 0.8 s), about 1 s a version on its own, against a few
milliseconds for the on-device sum (``bench/weight_sync.py`` measures both).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from moerl.weights.buckets import split_buckets
from moerl.weights.ipc_slots import OpenedSlots, Slots
from moerl.weights.store import table_digest

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


def table_word(entries) -> int:
    """The xxh3-64 of a bucket's (name, dtype, shape, offset) table as a signed 64-bit integer, added
    (wrapping) to the bytes' word sum to make a bucket's checksum (``with_table``)."""
    word = int(table_digest(entries, np.zeros(0, dtype=np.uint8)), 16)
    return word - (1 << 64) if word >= 1 << 63 else word


def with_table(bytes_sum: int, entries) -> int:
    """``bytes_sum`` (a bucket's wrapping int64 word sum) plus ``table_word(entries)``, wrapping."""
    return (bytes_sum + table_word(entries) + (1 << 63)) % (1 << 64) - (1 << 63)


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
    """Wall seconds from the first bucket's checksum to the last bucket's send (acknowledgements of the
    last ``num_slots`` buckets may still be outstanding)."""
    num_buckets: int
    """Buckets of the version."""
    nbytes: int
    """Bytes of the version's buckets (what each engine copies)."""
    num_engines: int
    """Engines it was sent to."""


class IpcPublisher:
    """Trainer side of ``runtime.weight_sync=cuda_ipc`` (module docstring).

    Args:
        template: the named tensors every version has (names, shapes, dtypes, one device); the bucket
            plan and the ring are made from it once.
        bucket_bytes: bucket size (``bucket_bytes_of(runtime.publish_bucket_mb)``).
        num_slots: buffers in the ring (2: the trainer fills one while engines copy the other).
        timeout_s: longest wait for an engine's acknowledgement; an engine that is later is dropped.
        slot_device: where the ring lives; None: the tensors' device (CUDA IPC on a GPU). ``"cpu"`` with
            CUDA tensors: host shared memory, page-locked in both processes (the pinned-host variant:
            device to host into the slot, host to device out of it).

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
        where = self.device if slot_device is None else torch.device(slot_device)
        self.ring = Slots(
            num_slots, max(x.nbytes for x in self.layouts), where, pin=self.device.type == "cuda"
        )
        self.slots = self.ring.buffers
        self.is_pinned = self.ring.is_pinned
        self.timeout_s = timeout_s
        self.engines: list = []
        """Connections of the engines (``multiprocessing.connection.Connection``)."""
        self._waiting: list[set[int]] = [set() for _ in self.slots]  # engine ids yet to ack each slot
        self._ids: dict[int, object] = {}
        self.last: IpcReport | None = None

    def connect(self, conn) -> None:
        """Add an engine: send it the ring's handles (pickled through ``conn``)."""
        conn.send(("slots", self.ring.handles))
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
        for index, names in enumerate(self.plan):
            slot_id = index % len(self.slots)
            self._await_acks(slot_id)
            checksum = self._fill(slot_id, self.layouts[index], [named[name] for name in names])
            layout = self.layouts[index]
            message = (
                "bucket",
                version,
                index,
                len(self.plan),
                slot_id,
                layout.entries,
                layout.nbytes,
                checksum,
            )
            for conn in list(self.engines):
                try:
                    conn.send(message)
                    self._waiting[slot_id].add(id(conn))
                except OSError:
                    self._drop(conn, "its connection closed")
        nbytes = sum(x.nbytes for x in self.layouts)
        self.last = IpcReport(version, time.perf_counter() - t0, len(self.plan), nbytes, len(self.engines))
        return self.last

    def _fill(self, slot_id: int, layout: _Layout, tensors: list[torch.Tensor]) -> int:
        """Checksum ``tensors`` on their device and copy them into slot ``slot_id``; the checksum.
        Syncs the device (the copies have landed when this returns)."""
        slot = self.slots[slot_id]
        checksum_no_sync = tensors_checksum_no_sync(tensors)
        ends = [start for _, _, _, start in layout.entries[1:]] + [layout.nbytes]
        is_async = slot.device.type == "cpu" and self.is_pinned  # device-to-host into page-locked memory
        for (_, _, _, start), end, t in zip(layout.entries, ends, tensors, strict=True):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            slot[start : start + raw.numel()].copy_(raw, non_blocking=is_async)
            slot[start + raw.numel() : end].zero_()  # the alignment padding is summed too
        checksum = with_table(int(checksum_no_sync), layout.entries)  # device sync
        if is_async:
            torch.cuda.synchronize()
        return checksum

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
        """Wait for the outstanding acknowledgements, close every engine connection, free the ring."""
        for slot_id in range(len(self.slots)):
            self._await_acks(slot_id)
        for conn in list(self.engines):
            conn.close()
        self.engines = []
        self.ring.close()


@dataclass(slots=True)
class IpcStats:
    """Engine-side figures (cumulative unless said otherwise)."""

    versions_applied: int = 0
    """Complete versions handed to the engine."""
    versions_dropped: int = 0
    """Versions given up (a bucket late, corrupt or lost, or superseded before it was taken)."""
    refused_versions: int = 0
    """Versions refused: a bucket's table and bytes failed the checksum (also in ``versions_dropped``)."""
    last_sync_s: float | None = None
    """Seconds from the first bucket's arrival to the whole version's arrival, last applied version."""
    last_bytes: int = 0
    """Bytes of the last applied version."""


@dataclass(slots=True)
class _Complete:
    version: int
    set_id: int
    tensors: dict[str, torch.Tensor]
    seconds: float
    nbytes: int


class IpcReceiver:
    """Engine side of ``runtime.weight_sync=cuda_ipc``; a ``WeightSource`` (module docstring).

    Args:
        conn: the connection to the ``IpcPublisher`` (which ``connect``ed its other end).
        device: where the receive buffers live (the engine's device).
        fallback: a ``WeightSource`` polled when no newer version has arrived whole (the store).
        timeout_s: longest wait for the next bucket of a version once its first one has arrived.
        background: receive on a thread into two sets of receive buffers (rollout workers), or inside
            ``poll`` into one set (module docstring).
    """

    def __init__(
        self,
        conn,
        device: torch.device | str,
        fallback=None,
        *,
        timeout_s: float = 60.0,
        background: bool = False,
    ) -> None:
        self.conn, self.device, self.fallback = conn, torch.device(device), fallback
        self.timeout_s = timeout_s
        self.stats = IpcStats()
        self.slots: OpenedSlots | None = None
        self.sets: list[dict[int, torch.Tensor]] = [{} for _ in range(2 if background else 1)]
        """Receive buffers: per set, bucket index -> flat uint8 buffer, reused across versions."""
        self._pending: tuple | None = None  # a bucket message read while a version was still arriving
        self._lock = threading.Lock()
        self._complete: _Complete | None = None  # background: the newest whole version not yet taken
        self._in_use: int | None = None  # background: the set the engine took at the last poll
        self._last_set = 1
        if background:
            threading.Thread(target=self._receive_loop, name="moerl-ipc-receive", daemon=True).start()

    @property
    def buffers(self) -> dict[int, torch.Tensor]:
        """The first set of receive buffers."""
        return self.sets[0]

    def poll(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest whole version newer than ``version`` (views of a set of receive buffers, valid until
        the next ``poll``: copy them into the engine now); else ``fallback.poll(version)``, else None.
        Without a background thread this takes a version whose first bucket is waiting, whole (blocks
        while the rest arrives)."""
        if len(self.sets) == 2:
            with self._lock:
                self._in_use = None  # the engine has copied what it took last time
                done, self._complete = self._complete, None
                if done is not None and done.version > version:
                    self._in_use = done.set_id
                    return self._applied(done)
        else:
            got = None
            while (message := self._next(0)) is not None:
                if message[1] <= version or message[2] != 0:
                    self._ack(message[4])
                    continue  # an old version, or the tail of a dropped one
                got = self._take(message, 0) or got
            if got is not None:
                return self._applied(got)
        return None if self.fallback is None else self.fallback.poll(version)

    def _applied(self, done: _Complete) -> tuple[int, dict[str, torch.Tensor]]:
        s = self.stats
        s.versions_applied += 1
        s.last_sync_s, s.last_bytes = done.seconds, done.nbytes
        return done.version, done.tensors

    def _receive_loop(self) -> None:
        """Background: take every version as it comes; stop when the trainer's connection closes."""
        while True:
            try:
                message = self._next(None)
            except IpcSyncError:
                return
            if message[2] != 0:
                self._ack(message[4])  # the tail of a dropped version
                continue
            with self._lock:
                set_id = 1 - self._last_set if self._in_use is None else 1 - self._in_use
                if self._complete is not None and self._complete.set_id == set_id:
                    self._complete = None  # superseded before the engine took it
                    self.stats.versions_dropped += 1
            done = self._take(message, set_id)
            if done is not None:
                with self._lock:
                    self._complete, self._last_set = done, set_id

    def _take(self, first: tuple, set_id: int) -> _Complete | None:
        """Receive the version whose bucket 0 is ``first`` into set ``set_id``; None if it was dropped."""
        t0 = time.perf_counter()
        _, version, _, num_buckets, *_ = first
        bufs, tensors, nbytes, message = self.sets[set_id], {}, 0, first
        try:
            for index in range(num_buckets):
                if index > 0 and (message := self._next(self.timeout_s)) is None:
                    raise IpcSyncError(f"no bucket within {self.timeout_s:.0f} s")
                _, v, i, n, slot_id, entries, size, checksum = message
                if (v, i, n) != (version, index, num_buckets):
                    self._pending = message  # a newer version started: this one will never be whole
                    raise IpcSyncError(f"bucket {index}/{num_buckets} replaced by bucket {i} of version {v}")
                buf = bufs.get(index)
                if buf is None or buf.numel() != size:
                    buf = bufs[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
                buf.copy_(self.slots.buffers[slot_id][:size], non_blocking=self.slots.is_pinned)
                got = int(_checksum_no_sync(buf))  # device sync: the copy is done before the ack
                self._ack(slot_id)
                got = with_table(got, entries)
                if got != checksum:
                    self.stats.refused_versions += 1
                    raise IpcSyncError(
                        f"bucket {index + 1}/{num_buckets}: checksum {got} of its table and bytes != {checksum}"
                    )
                nbytes += size
                for name, dtype, shape, start in entries:
                    length = math.prod(shape) * dtype.itemsize
                    tensors[name] = buf[start : start + length].view(dtype).view(shape)
        except IpcSyncError as e:
            log.error("weight version %d dropped: %s", version, e)
            self.stats.versions_dropped += 1
            return None
        return _Complete(version, set_id, tensors, time.perf_counter() - t0, nbytes)

    def _next(self, timeout_s: float | None) -> tuple | None:
        """The next bucket message within ``timeout_s`` (None: no limit), else None; the slot handles
        are mapped on the way.

        Raises:
            IpcSyncError: the trainer's connection closed.
        """
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message
        while True:
            try:
                if not self.conn.poll(timeout_s):
                    return None
                message = self.conn.recv()
            except (EOFError, OSError) as e:
                raise IpcSyncError("the trainer's connection closed") from e
            if message[0] != "slots":
                return message
            self.slots = OpenedSlots(message[1], pin=self.device.type == "cuda")  # mapped once

    def _ack(self, slot_id: int) -> None:
        try:
            self.conn.send(("ack", slot_id))
        except OSError:
            pass  # the trainer is gone; the next _next says so

    @property
    def refused_versions(self) -> int:
        """``stats.refused_versions``."""
        return self.stats.refused_versions

    def close(self) -> None:
        """Close the connection (a background thread then ends)."""
        self.conn.close()
