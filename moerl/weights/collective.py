"""``runtime.weight_sync=collective``: weight buckets broadcast over one small ``torch.distributed`` group
per rollout worker (gloo on CPU buffers).

    driver:   TCPStore (master; the rendezvous, ``CollectiveTransport`` owns it)
    sender:   the process holding the weights (the one-process trainer's, or trainer rank 0); a
              ``CollectiveSender`` there admits joined workers, each into a group of its own
              [sender = rank 0, the worker's EP ranks = 1..n], and broadcasts every bucket to each group
    worker:   each rank's ``CollectiveReceiver`` registers, waits for its group, then receives on its own
              thread and hands every bucket to a ``BucketAssembler`` (version, index and xxh3 checked;
              the version switches only when whole, between scheduler steps)

Rendezvous keys (all in the driver's TCPStore): a worker's rank 0 takes a slot ``n = add("num_joined")``
and writes ``join/<n> = <gid>:<num_ranks>``; each rank writes ``ready/<gid>/<r>`` once its receiving
thread runs. The sender claims ``claim/<gid>`` (``compare_set``: a restarted sender never takes a group
of an earlier sender's), writes ``go/<gid>`` and builds a ``ProcessGroupGloo`` over
``PrefixStore("g/<gid>/")``; each of the worker's ranks builds it too once it sees ``go/<gid>``. The
groups are stateless (no default process group): the workers come and go, and a lost worker only loses
its own group (a sender-side timeout or error drops it: ``dropped/<gid>``, the worker's receivers
raise ``WeightTransportError`` and the worker ends as crashed).

On the wire, per bucket and group: a header ``int64[5]`` (version, index, num_buckets, nbytes,
table_len), the table (JSON of checksum and (name, dtype, shape, offset) entries, uint8) and the
bytes (uint8). The sender keeps the newest complete version's buckets so that a worker admitted
between publishes gets it at once.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from moerl.weights.buckets import BucketAssembler, SyncStats, WeightBucket
from moerl.weights.transports import ensure_durable, write_durable

log = logging.getLogger(__name__)

_HEADER = 5
"""int64 fields of a bucket's header: version, index, num_buckets, nbytes, table_len."""
_IDLE_S = 24 * 3600.0
"""A receiver's collective timeout: it waits for the next version as long as the sender lives (a gone
sender fails its socket at once; a dropped group is seen through the store)."""


class WeightTransportError(RuntimeError):
    """A worker's weight transport failed (its group was dropped or broke): the worker is lost."""


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight bucket's table")
    return dtype


def encode_table(bucket: WeightBucket) -> bytes:
    """The bucket's checksum and (name, dtype, shape, offset) entries as JSON bytes."""
    entries = [[n, str(d), list(s), o] for n, d, s, o in bucket.entries]
    return json.dumps({"checksum": bucket.checksum, "entries": entries}).encode()


def decode_bucket(header: list[int], table: bytes, data: np.ndarray) -> WeightBucket:
    """A ``WeightBucket`` from what a receiver got (the checksum is verified later, by the assembler)."""
    version, index, num_buckets, _, _ = header
    meta = json.loads(table)
    entries = tuple((n, _dtype_of(d), tuple(s), o) for n, d, s, o in meta["entries"])
    return WeightBucket(version, index, num_buckets, entries, meta["checksum"], data)


@dataclass(frozen=True, slots=True)
class CollectiveAddress:
    """Where the rendezvous store is, and the collectives' timeout."""

    host: str
    """The driver's address, as the workers and trainer rank 0 reach it."""
    port: int
    """The TCPStore's port."""
    timeout_s: float = 60.0
    """Most seconds of a sender-side collective (a group's creation, a bucket's broadcast) and of a
    store call; a group that misses it is dropped (``runtime.collective_timeout_s``)."""

    def connect(self) -> dist.TCPStore:
        """A client of the rendezvous store."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)


def _bcast(pg, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


@dataclass(slots=True)
class _Group:
    gid: str
    num_ranks: int
    pg: object


class CollectiveSender:
    """The sending side, in the process that holds the weights (one per rendezvous address and process:
    ``CollectiveSender.of``). ``send`` broadcasts one bucket to every admitted group; a background
    thread admits workers between publishes and sends them the newest complete version.

    Args:
        address: the rendezvous store.
        admit_every_s: how often the background thread looks for joined workers (0: no thread;
            ``admit`` is then called by ``send`` and by tests).
    """

    _instances: dict[tuple[str, int], CollectiveSender] = {}
    _instances_lock = threading.Lock()
    tamper: Callable[[WeightBucket], np.ndarray] | None = None
    """Test hook: the bytes actually sent for a bucket (after its checksum was taken); None: its own."""

    @classmethod
    def of(cls, address: CollectiveAddress) -> CollectiveSender:
        """This process's sender for ``address`` (made at the first call)."""
        with cls._instances_lock:
            key = (address.host, address.port)
            if key not in cls._instances:
                cls._instances[key] = cls(address)
            return cls._instances[key]

    def __init__(self, address: CollectiveAddress, *, admit_every_s: float = 0.2) -> None:
        self.address = address
        self.store = address.connect()
        self.epoch = str(self.store.add("sender_epoch", 1))
        self.groups: list[_Group] = []
        self.dropped: list[_Group] = []  # kept: a failed gloo group is aborted, never destroyed in a hurry
        self.newest: list[WeightBucket] = []
        self._incoming: list[WeightBucket] = []
        self._seen_joins = 0
        self._waiting: dict[str, int] = {}  # gid -> ranks, joined but not all ready
        self._lock = threading.RLock()
        self._in_version = False
        self._closed = threading.Event()
        if admit_every_s > 0:
            threading.Thread(target=self._admit_loop, args=(admit_every_s,), daemon=True).start()

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.address.timeout_s)

    def _admit_loop(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            try:
                with self._lock:
                    if not self._in_version:
                        for group in self.admit():
                            self._send_all(self.newest, [group])
            except Exception:  # the store is gone (the run ends): nothing to admit
                log.debug("collective sender: admission stopped", exc_info=True)
                return

    def admit(self) -> list[_Group]:
        """Build the group of every worker whose ranks are all ready; returns the new groups (not yet
        sent anything). A group that cannot be built within the timeout is dropped."""
        with self._lock:
            num_joined = self.store.add("num_joined", 0)
            for n in range(self._seen_joins, num_joined):
                gid, size = self.store.get(f"join/{n}").decode().split(":")
                self._waiting[gid] = int(size)
            self._seen_joins = num_joined
            new = []
            for gid, size in list(self._waiting.items()):
                if not self.store.check([f"ready/{gid}/{r}" for r in range(size)]):
                    continue
                del self._waiting[gid]
                if self.store.compare_set(f"claim/{gid}", "", self.epoch).decode() != self.epoch:
                    continue  # an earlier sender's worker
                self.store.set(f"go/{gid}", "1")
                try:
                    pg = dist.ProcessGroupGloo(
                        dist.PrefixStore(f"g/{gid}/", self.store), 0, size + 1, self.timeout
                    )
                except Exception as e:
                    self._drop(_Group(gid, size, None), e)
                    continue
                group = _Group(gid, size, pg)
                self.groups.append(group)
                new.append(group)
            return new

    def send(self, bucket: WeightBucket) -> None:
        """Broadcast ``bucket`` to every group (its bytes are sent before this returns; the caller may
        reuse its buffer). Bucket 0 of a version first admits the workers ready by then; the version's
        last bucket makes it the newest kept for late joiners."""
        with self._lock:
            if bucket.index == 0:
                self.admit()
                self._in_version, self._incoming = True, []
            self._incoming.append(replace(bucket, data=bucket.data.copy()))
            self._send_all([bucket], list(self.groups))
            if bucket.index == bucket.num_buckets - 1:
                self.newest, self._incoming, self._in_version = self._incoming, [], False

    def _send_all(self, buckets: list[WeightBucket], groups: list[_Group]) -> None:
        """Every bucket to every group: the broadcasts of all groups are in flight at once; a group whose
        broadcast fails or misses the timeout is dropped."""
        for bucket in buckets:
            payload = bucket.data if CollectiveSender.tamper is None else CollectiveSender.tamper(bucket)
            table = np.frombuffer(encode_table(bucket), dtype=np.uint8)
            header = torch.tensor(
                [bucket.version, bucket.index, bucket.num_buckets, bucket.nbytes, table.size],
                dtype=torch.int64,
            )
            parts = [header, torch.from_numpy(table.copy()), torch.from_numpy(np.ascontiguousarray(payload))]
            works = []
            for g in groups:
                try:
                    works.append((g, [_bcast(g.pg, t) for t in parts]))
                except Exception as e:
                    self._drop(g, e)
            for g, ws in works:
                try:
                    for w in ws:
                        w.wait(self.timeout)
                except Exception as e:
                    self._drop(g, e)
            groups = [g for g in groups if g in self.groups]

    def _drop(self, group: _Group, error: BaseException) -> None:
        log.warning("weight group %s dropped (its worker is lost): %s", group.gid, error)
        if group in self.groups:
            self.groups.remove(group)
        self.dropped.append(group)
        try:
            self.store.set(f"dropped/{group.gid}", "1")
            if group.pg is not None:
                group.pg.abort()
        except Exception:
            pass

    def close(self) -> None:
        """Stop admitting and abort every group."""
        self._closed.set()
        with self._lock:
            for g in self.groups:
                try:
                    g.pg.abort()
                except Exception:
                    pass
            self.groups = []
        with CollectiveSender._instances_lock:
            CollectiveSender._instances.pop((self.address.host, self.address.port), None)


class CollectiveReceiver:
    """The receiving side of one worker rank: a ``WeightSource`` (``poll``) fed by its own thread.

    Args:
        address: the rendezvous store.
        gid: the worker's group id (the same for all its EP ranks).
        rank: this EP rank of the worker (0: the one that registers the worker).
        num_ranks: the worker's ranks (``rollout.ep_size``).
        fallback: a ``WeightSource`` polled when no newer complete version has arrived (the store).

    ``poll`` raises ``WeightTransportError`` once the group failed (dropped by the sender, or broken).
    """

    def __init__(
        self, address: CollectiveAddress, gid: str, rank: int, num_ranks: int, fallback=None
    ) -> None:
        self.address, self.gid, self.rank, self.num_ranks = address, gid, rank, num_ranks
        self.assembler = BucketAssembler(lambda b: b, fallback, background=False)
        self.joined = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moerl-weight-collective", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> SyncStats:
        """Worker-side figures (``BucketAssembler.stats``; ``refused_buckets`` counts damaged ones)."""
        return self.assembler.stats

    @property
    def refused_versions(self) -> int:
        """Versions refused (a bucket damaged in transit: ``stats.refused_versions``)."""
        return self.assembler.stats.refused_versions

    @property
    def fallback(self):
        """The ``WeightSource`` polled when nothing newer arrived (the store)."""
        return self.assembler.fallback

    def poll(self, version: int):
        """The newest complete received version newer than ``version``, else the fallback's, else None.

        Raises:
            WeightTransportError: the group failed.
        """
        if self.error is not None:
            raise WeightTransportError(f"weight group {self.gid} (rank {self.rank}) failed: {self.error}")
        return self.assembler.poll(version)

    def close(self) -> None:
        """Stop the receiving thread (and abort its group)."""
        self._stop.set()

    def _run(self) -> None:
        pg = None
        try:
            store = self.address.connect()
            if self.rank == 0:
                n = store.add("num_joined", 1) - 1
                store.set(f"join/{n}", f"{self.gid}:{self.num_ranks}")
            store.set(f"ready/{self.gid}/{self.rank}", "1")
            while not store.check([f"go/{self.gid}"]):
                if self._stop.wait(0.05):
                    return
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"g/{self.gid}/", store),
                self.rank + 1,
                self.num_ranks + 1,
                datetime.timedelta(seconds=_IDLE_S),
            )
            self.joined.set()
            while not self._stop.is_set():
                self._receive_one(pg, store)
        except Exception as e:
            if not self._stop.is_set():
                log.error("weight group %s rank %d failed: %s", self.gid, self.rank, e)
                self.error = e
        finally:
            if pg is not None:
                try:
                    pg.abort()
                except Exception:
                    pass

    def _receive_one(self, pg, store) -> None:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._wait(_bcast(pg, header), store)
        fields = [int(x) for x in header.tolist()]
        table = torch.empty(fields[4], dtype=torch.uint8)
        data = torch.empty(fields[3], dtype=torch.uint8)
        self._wait(_bcast(pg, table), store)
        self._wait(_bcast(pg, data), store)
        bucket = decode_bucket(fields, table.numpy().tobytes(), data.numpy())
        self.assembler.offer(bucket.version, bucket.index, bucket.num_buckets, bucket)

    def _wait(self, work, store) -> None:
        """Wait for a broadcast, checking now and then whether the sender dropped this group."""
        next_check = time.monotonic() + 0.5
        while not work.is_completed():
            if self._stop.wait(0.002):
                raise WeightTransportError("receiver closed")
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 0.5
                if store.check([f"dropped/{self.gid}"]):
                    raise WeightTransportError(f"the sender dropped weight group {self.gid}")
        work.wait()  # re-raises a failed broadcast


def new_group_id() -> str:
    """A fresh worker group id."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True)
class CollectiveSink:
    """A ``BucketSink``: ``send`` broadcasts through this process's ``CollectiveSender`` (picklable:
    travels to trainer rank 0, which keeps its sender and groups across versions)."""

    address: CollectiveAddress

    def send(self, bucket: WeightBucket) -> None:
        """Broadcast ``bucket`` to every admitted worker (returns once its bytes are sent)."""
        CollectiveSender.of(self.address).send(bucket)


@dataclass(frozen=True, slots=True)
class CollectiveSpec:
    """Worker side of ``collective``: the rendezvous and (per worker) its group id and ranks."""

    address: CollectiveAddress
    gid: str = ""
    num_ranks: int = 1

    def for_worker(self, num_ranks: int) -> CollectiveSpec:
        """A new group of ``num_ranks`` ranks (the worker's EP ranks)."""
        return replace(self, gid=new_group_id(), num_ranks=num_ranks)

    def open(self, *, fallback, device, rank: int = 0) -> CollectiveReceiver:
        """This rank's receiver (its thread registers it and waits for the group)."""
        if not self.gid:
            raise ValueError("CollectiveSpec.open: no group id (call for_worker first)")
        return CollectiveReceiver(self.address, self.gid, rank, self.num_ranks, fallback)


def _node_address() -> str:
    """This node's address as Ray sees it (reachable from the workers), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class CollectiveTransport:
    """``runtime.weight_sync=collective``: a ``torch.distributed`` group per rollout worker between the
    trainer's sender (the one-process trainer's process, or trainer rank 0) and every rank of the
    worker (EP followers included), broadcasting buckets of ``publish_bucket_mb`` with the same version
    and xxh3 rules as ``object_store``; gloo on CPU buffers. The durable store is written every
    ``durable_every`` versions, in the background (``write_durable``). For fleets where the object store is the
    bottleneck, or for trainers without Ray rank actors (module docstring)."""

    name = "collective"
    supports_ep_rollout = True
    sends_from_snapshot = False

    @staticmethod
    def check_config(runtime, *, trainer_ranks: int, rollout_ep_size: int) -> None:
        """Every combination works (sync mode hands weights over in process)."""

    def __init__(self, runtime, store) -> None:
        from moerl.weights.buckets import bucket_bytes_of

        self.store, self.durable_every = store, runtime.durable_every
        self.bucket_bytes = bucket_bytes_of(runtime.publish_bucket_mb)
        host = _node_address()
        self._master = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.address = CollectiveAddress(host, self._master.port, runtime.collective_timeout_s)

    def publish(self, trainer, workers, *, durable: bool | None = None):
        """The trainer's sender broadcasts its buckets to every admitted worker; the store when due."""
        from moerl.weights.buckets import PublishReport

        streamed = trainer.stream_buckets(CollectiveSink(self.address), self.bucket_bytes)
        version = streamed.version
        is_durable = self.store is not None and (
            version % self.durable_every == 0 if durable is None else durable
        )
        if is_durable:  # a host snapshot now, the write on the store's thread (a group: its own publish)
            write_durable(self.store, trainer)
        return PublishReport(
            version,
            streamed.seconds,
            len(streamed.refs),
            streamed.nbytes,
            streamed.nbytes * len(workers),
            is_durable,
        )

    def offer_newest(self, worker) -> None:
        """Nothing: the sender sends the newest version to a worker as it admits it."""

    def receiver_spec(self) -> CollectiveSpec:
        """The rendezvous; each worker takes its own group (``for_worker``)."""
        return CollectiveSpec(self.address)

    def finish(self, trainer) -> None:
        """The last version in the store."""
        if self.store is not None:
            ensure_durable(self.store, trainer)

    def close(self) -> None:
        """Close this process's sender (a one-process trainer's); a rank 0's ends with its process."""
        sender = CollectiveSender._instances.get((self.address.host, self.address.port))
        if sender is not None:
            sender.close()
