"""Tampered tensor tables are refused by every transport of ``TRANSPORTS`` and by the durable store.

A version's table is its (name, dtype, shape, offset) entries. Two ways it can be wrong:
- changed in transit or at rest, after the sender sealed it (two same-shape names swapped, a dtype
  changed, a shape changed, an entry dropped): the checksum over table and bytes fails;
- sealed wrong (a self-consistent table that is not the engine's parameter set: a dtype, a shape, an
  entry dropped): ``CheckedWeights`` refuses it. (A self-consistent swap of two same-shape names is a
  different model of the same parameter set: no receiver can tell.)
Each refused version is never switched to and is counted once (``refused_versions_of``, the worker's
``weights/refused_total``); the next good version switches, with tensors equal to what was sent.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save as st_save

from moerl.config import load_config
from moerl.records import FileEntry, TensorEntry, WeightManifest
from moerl.weights import transports as transports_module
from moerl.weights.buckets import BucketAssembler, bucket_digest, iter_packed
from moerl.weights.ipc import IpcPublisher, IpcReceiver, table_word, with_table
from moerl.weights.sources import CheckedWeights, StoreWeights, refused_versions_of
from moerl.weights.store import WeightStore, _dtype_name, _sha256, pack_weights, table_digest, unpack_weights
from moerl.weights.transport import TRANSPORTS, make_transport
from moerl.weights.transports import OfferedWeights, stream_named


def _tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "a.weight": torch.randn(4, 4, generator=g),
        "b.weight": torch.randn(4, 4, generator=g),  # the same shape as a.weight: a swap is silent
        "c.bias": torch.randn(4, generator=g),
    }


ENGINE = {n: (t.dtype, tuple(t.shape)) for n, t in _tensors(0).items()}
"""The engine's parameter set (``parameter_set`` of its model)."""


def _swap(entries):
    names = {"a.weight": "b.weight", "b.weight": "a.weight"}
    return tuple((names.get(n, n), d, s, o) for n, d, s, o in entries)


def _dtype(entries):
    return tuple((n, torch.int32 if n == "a.weight" else d, s, o) for n, d, s, o in entries)


def _shape(entries):
    return tuple((n, d, (2, 8) if n == "a.weight" else s, o) for n, d, s, o in entries)


def _drop(entries):
    return tuple(e for e in entries if e[0] != "c.bias")


CASES = [
    ("names swapped in transit", _swap, False),
    ("dtype changed in transit", _dtype, False),
    ("shape changed in transit", _shape, False),
    ("entry dropped in transit", _drop, False),
    ("dtype sealed wrong", _dtype, True),
    ("shape sealed wrong", _shape, True),
    ("entry dropped, sealed", _drop, True),
]
"""(what, table change, resealed: the checksum recomputed over the changed table)."""


class Tamper:
    """What the channel does to the next version's table: ``change`` (None: nothing), ``reseal``."""

    change = None
    reseal = False


# ---- one channel per transport: ``send(version)`` delivers ``_tensors(version)`` through it, with the
# ---- table changed as ``tamper`` says; ``receiver`` is the worker's WeightSource (before CheckedWeights)


class ObjectStoreChannel:
    """``object_store``: buckets by ref (the ref resolves to the bucket itself: Ray's get is identity)."""

    def __init__(self, tamper, tmp_path, monkeypatch):
        self.tamper = tamper
        self.receiver = BucketAssembler(lambda b: b, None, background=False)

    def send(self, version):
        for bucket in iter_packed(version, _tensors(version), 1 << 20):
            if self.tamper.change is not None:
                entries = self.tamper.change(bucket.entries)
                checksum = bucket_digest(entries, bucket.data) if self.tamper.reseal else bucket.checksum
                bucket = dataclasses.replace(bucket, entries=entries, checksum=checksum)
            self.receiver.offer(version, bucket.index, bucket.num_buckets, bucket)

    def close(self):
        self.receiver.close()


class StoreOfferChannel:
    """``store``: whole versions as ``PackedWeights`` offered by ref (identity ``ray.get``)."""

    def __init__(self, tamper, tmp_path, monkeypatch):
        monkeypatch.setattr(transports_module, "_ray", lambda: SimpleNamespace(get=lambda ref: ref))
        self.tamper = tamper
        self.receiver = OfferedWeights(None)

    def send(self, version):
        packed = pack_weights(_tensors(version))
        if self.tamper.change is not None:
            entries = self.tamper.change(packed.entries)
            checksum = table_digest(entries, packed.data) if self.tamper.reseal else packed.checksum
            packed = dataclasses.replace(packed, entries=entries, checksum=checksum)
        self.receiver.offer(version, packed)

    def close(self):
        pass


class _Trainer:
    """The ``WeightHolder`` a transport asks; its buckets go through ``tamper`` on their way out."""

    def __init__(self, tamper):
        self.tamper, self.version = tamper, 0

    def named_weights(self):
        return _tensors(self.version)

    def publish(self, store):
        return store.publish(self.version, self.named_weights())

    def stream_buckets(self, sink, bucket_bytes):
        tamper = self.tamper

        class TamperingSink:
            def send(self, bucket):
                if tamper.change is not None:
                    entries = tamper.change(bucket.entries)
                    checksum = bucket_digest(entries, bucket.data) if tamper.reseal else bucket.checksum
                    bucket = dataclasses.replace(bucket, entries=entries, checksum=checksum)
                return sink.send(bucket)

        return stream_named(self.version, self.named_weights(), bucket_bytes, TamperingSink())


class CollectiveChannel:
    """``collective``: the real transport (gloo broadcast to a receiver in this process)."""

    def __init__(self, tamper, tmp_path, monkeypatch):
        runtime = load_config(None, ["runtime.weight_sync=collective"]).runtime
        self.transport = make_transport(runtime, None)
        self.trainer = _Trainer(tamper)
        self.receiver = self.transport.receiver_spec().for_worker(1).open(fallback=None, device="cpu")

    def send(self, version):
        self.trainer.version = version
        self.transport.publish(self.trainer, workers=[object()], durable=False)

    def close(self):
        self.receiver.close()
        self.transport.close()


class _TamperingConn:
    """The trainer's end of a ``cuda_ipc`` connection; bucket messages' tables changed on the way."""

    def __init__(self, conn, tamper):
        self.conn, self.tamper = conn, tamper

    def send(self, message):
        if message[0] == "bucket" and self.tamper.change is not None:
            kind, version, index, n, slot, entries, size, checksum = message
            changed = self.tamper.change(entries)
            if self.tamper.reseal:  # the bytes' word sum, with the changed table's word instead
                checksum = with_table(checksum - table_word(entries), changed)
            message = (kind, version, index, n, slot, changed, size, checksum)
        self.conn.send(message)

    def __getattr__(self, name):
        return getattr(self.conn, name)


class CudaIpcChannel:
    """``cuda_ipc``, its CPU part: the ring in host shared memory, mapped by a receiver in this process."""

    def __init__(self, tamper, tmp_path, monkeypatch):
        parent, child = mp.Pipe()
        self.publisher = IpcPublisher(_tensors(0), 1 << 20, num_slots=1, timeout_s=10)
        self.publisher.connect(_TamperingConn(parent, tamper))
        self.receiver = IpcReceiver(child, "cpu", timeout_s=10)

    def send(self, version):
        self.publisher.publish(version, _tensors(version))

    def close(self):
        self.publisher.close()


class DurableStoreChannel:
    """The durable ``WeightStore`` polled by ``StoreWeights``: the version's file (and, resealed, its
    manifest) rewritten with the changed table over the same bytes."""

    def __init__(self, tamper, tmp_path, monkeypatch):
        self.tamper = tamper
        self.root = tmp_path / "weights"
        self.store = WeightStore(str(self.root), keep=2)
        self.receiver = StoreWeights(self.store, interval_s=0.0)

    def send(self, version):
        tensors = _tensors(version)
        self.store.publish(version, tensors)
        if self.tamper.change is None:
            return
        packed = pack_weights(tensors)
        changed = unpack_weights(
            dataclasses.replace(packed, entries=self.tamper.change(packed.entries)), verify=False
        )
        data = st_save(changed)
        vdir = self.root / f"v{version:08d}"
        (vdir / "model.safetensors").write_bytes(data)
        if self.tamper.reseal:
            manifest = WeightManifest(
                version,
                time.time(),
                (FileEntry("model.safetensors", _sha256(data), len(data)),),
                tuple(
                    TensorEntry(n, tuple(t.shape), _dtype_name(t.dtype), "model.safetensors")
                    for n, t in sorted(changed.items())
                ),
            )
            (vdir / "manifest.json").write_text(json.dumps(manifest.to_json_dict()))

    def close(self):
        pass


CHANNELS = {
    "object_store": ObjectStoreChannel,
    "store": StoreOfferChannel,
    "collective": CollectiveChannel,
    "cuda_ipc": CudaIpcChannel,
    "durable store": DurableStoreChannel,
}


def test_every_transport_has_a_channel_here():
    assert set(TRANSPORTS) <= set(CHANNELS)


def _receive(source, newer_than: int, refused_before: int, timeout_s: float = 20.0):
    """Poll until a version newer than ``newer_than`` switches (returned) or one more is refused (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = source.poll(newer_than)
        if got is not None:
            return got
        if refused_versions_of(source) > refused_before:
            return None
        time.sleep(0.005)
    raise AssertionError(f"nothing newer than version {newer_than} arrived or was refused in {timeout_s} s")


@pytest.mark.parametrize("transport", sorted(CHANNELS))
def test_a_tampered_table_is_refused_counted_and_the_next_good_version_switches(
    transport, tmp_path, monkeypatch
):
    tamper = Tamper()
    channel = CHANNELS[transport](tamper, tmp_path, monkeypatch)
    worker = CheckedWeights(channel.receiver, ENGINE)  # as a rollout worker wraps its source
    engine_version = 0
    try:
        for i, (what, change, reseal) in enumerate(CASES):
            bad, good = 2 * i + 1, 2 * i + 2
            tamper.change, tamper.reseal = change, reseal
            channel.send(bad)
            assert _receive(worker, engine_version, i) is None, f"{transport}: {what} was switched to"
            assert refused_versions_of(worker) == i + 1, f"{transport}: {what} not counted once"
            tamper.change = None
            channel.send(good)
            got = _receive(worker, engine_version, i + 1)
            assert got is not None and got[0] == good, f"{transport}: the good version after {what}"
            assert {n: (t.dtype, tuple(t.shape)) for n, t in got[1].items()} == ENGINE
            assert all(torch.equal(got[1][n], t) for n, t in _tensors(good).items())
            engine_version = good
    finally:
        channel.close()


def test_sync_mode_stops_in_one_line_when_its_worker_refuses_the_pushed_version():
    from moerl.errors import WeightVersionRefused
    from moerl.runtime.local import LocalRollouts
    from moerl.weights.sources import LocalWeights

    weights = CheckedWeights(LocalWeights(), ENGINE)

    class Worker:  # the RolloutWorker's weight loading (and the counters fleet_values reads), nothing else
        version = -1
        stats = types.SimpleNamespace(
            weight_updates=0, last_weight_load_s=None, tokens_resumed=0, tokens_discarded=0
        )

        def sync_weights(self):
            found = weights.poll(self.version)
            if found is not None:
                self.version = found[0]

    rollouts = LocalRollouts(None, None, Worker(), weights)
    weights.push(1, _tensors(1))
    rollouts._check_not_refused()  # switched to version 1
    weights.push(2, _drop_entry(_tensors(2)))
    with pytest.raises(WeightVersionRefused, match="refused weight version 2 .* on-policy only"):
        rollouts._check_not_refused()
    assert rollouts.fleet_values(1)["weights/refused_total"] == 1


def _drop_entry(tensors: dict) -> dict:
    return {n: t for n, t in tensors.items() if n != "c.bias"}
