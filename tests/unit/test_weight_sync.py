"""Bucketed weight sync (moerl.weights.buckets): buckets, checksums, whole-version switching, the
durable store written in the background from the packed buckets."""

import dataclasses
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moerl.runtime.fleet import WorkerHealth, WorkerRecord
from moerl.runtime.ray.rollouts import RayRollouts, version_lags
from moerl.weights.buckets import (
    BucketAssembler,
    BucketPublisher,
    bucket_bytes_of,
    iter_packed,
    pack_bucket,
    split_buckets,
    unpack_bucket,
)
from moerl.weights.store import ChecksumError, WeightStore


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "b.weight": torch.randn(8, 8, generator=g),  # 256 bytes
        "a.bias": torch.randn(3, generator=g),  # 12 bytes
        "c.half": torch.randn(5, 4, generator=g).to(torch.bfloat16),  # 40 bytes
        "d.ids": torch.arange(7, dtype=torch.int64),  # 56 bytes
    }


def test_split_buckets_keeps_name_order_and_size_bound():
    plan = split_buckets(_tensors(), 260)
    names = [n for b in plan for n, _ in b]
    assert names == sorted(_tensors())
    assert [[n for n, _ in b] for b in plan] == [["a.bias"], ["b.weight"], ["c.half", "d.ids"]]
    assert len(split_buckets(_tensors(), 10**9)) == 1
    with pytest.raises(ValueError):
        split_buckets({}, 10)
    assert bucket_bytes_of(0.5) == 2**19


def test_pack_unpack_roundtrip_and_checksum_catches_corruption():
    named = _tensors()
    buckets = list(iter_packed(4, named, 260))
    assert [(b.version, b.index, b.num_buckets) for b in buckets] == [(4, i, 3) for i in range(3)]
    out = dict(kv for b in buckets for kv in unpack_bucket(b))
    assert out.keys() == named.keys()
    for k, v in named.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
    bad = buckets[1].data.copy()
    bad[5] ^= 0xFF
    with pytest.raises(ChecksumError, match="bucket 2/3 of version 4"):
        unpack_bucket(dataclasses.replace(buckets[1], data=bad))


def test_assembler_switches_only_on_a_whole_version_in_any_order():
    fallback_calls = []

    class Fallback:
        def poll(self, version):
            fallback_calls.append(version)
            return None

    asm = BucketAssembler(lambda ref: ref, Fallback(), background=False)
    v1 = list(iter_packed(1, _tensors(1), 100))
    assert len(v1) >= 3
    for b in reversed(v1[1:]):
        asm.offer(1, b.index, b.num_buckets, b)
        assert asm.poll(0) is None  # not whole yet: the worker keeps its version
    asm.offer(1, 0, v1[0].num_buckets, v1[0])
    version, tensors = asm.poll(0)
    assert version == 1 and all(torch.equal(tensors[k], v) for k, v in _tensors(1).items())
    assert asm.stats.versions_applied == 1 and asm.stats.last_bytes == sum(b.nbytes for b in v1)
    assert asm.poll(1) is None and fallback_calls  # nothing newer: asks the fallback
    # a newer version's buckets replace an unfinished older one; a stale bucket is ignored
    v2, v3 = list(iter_packed(2, _tensors(2), 100)), list(iter_packed(3, _tensors(3), 100))
    asm.offer(2, 0, v2[0].num_buckets, v2[0])
    for b in v3:
        asm.offer(3, b.index, b.num_buckets, b)
    asm.offer(2, 1, v2[1].num_buckets, v2[1])
    version, tensors = asm.poll(1)
    assert version == 3 and torch.equal(tensors["b.weight"], _tensors(3)["b.weight"])
    assert asm.stats.dropped_versions == 1


def test_assembler_drops_a_version_with_a_corrupt_or_misfiled_bucket():
    asm = BucketAssembler(lambda ref: ref, None, background=False)
    v1 = list(iter_packed(1, _tensors(), 100))
    bad = v1[0].data.copy()
    bad[0] ^= 1
    asm.offer(1, 0, v1[0].num_buckets, dataclasses.replace(v1[0], data=bad))
    for b in v1[1:]:
        asm.offer(1, b.index, b.num_buckets, b)
    assert asm.poll(0) is None
    v2 = list(iter_packed(2, _tensors(), 100))
    asm.offer(2, 0, v2[0].num_buckets, v1[1])  # another version's bucket under v2's name
    for b in v2[1:]:
        asm.offer(2, b.index, b.num_buckets, b)
    assert asm.poll(0) is None


def test_assembler_background_thread_fetches():
    asm = BucketAssembler(lambda ref: ref, None, background=True)
    for b in iter_packed(1, _tensors(), 100):
        asm.offer(1, b.index, b.num_buckets, b)

    deadline = time.monotonic() + 5
    found = None
    while found is None and time.monotonic() < deadline:
        found = asm.poll(0)
        time.sleep(0.01)
    asm.close()
    assert found is not None and found[0] == 1


def test_a_bucket_that_cannot_be_fetched_skips_its_version_in_one_line(caplog):
    """A worker back from a partition finds the versions it missed freed by their owner: the fetch thread
    says so in one line (no traceback in the run's output), skips that version and takes the next."""

    class Freed(Exception):
        pass

    def resolve(ref):
        if ref is None:
            raise Freed("Failed to retrieve object 00ab.\nThe object has already been deleted.")
        return ref

    asm = BucketAssembler(resolve, None, background=True)
    v2 = list(iter_packed(2, _tensors(), 100))
    with caplog.at_level(logging.WARNING, logger="moerl.weights.buckets"):
        asm.offer(1, 0, 2, None)  # version 1's bucket was freed
        for b in v2:
            asm.offer(2, b.index, b.num_buckets, b)
        deadline, found = time.monotonic() + 5, None
        while found is None and time.monotonic() < deadline:
            found = asm.poll(0)
            time.sleep(0.01)
        asm.close()
    assert found is not None and found[0] == 2
    lines = [r for r in caplog.records if "could not be fetched" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None, caplog.text  # one line, no traceback
    assert "version 1 could not be fetched (Freed: Failed to retrieve object 00ab.)" in lines[0].getMessage()


class Staging:
    """``BucketAssembler``'s ``stage`` on CPU (page-locked on a GPU): records the buffers it makes."""

    def __init__(self):
        self.buffers = []

    def __call__(self, nbytes):
        self.buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.buffers[-1]

    def owns(self, t: torch.Tensor) -> bool:
        p = t.untyped_storage().data_ptr()
        return any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b in self.buffers)


def test_staged_versions_come_from_reused_staging_buffers_never_written_while_held():
    stage = Staging()
    asm = BucketAssembler(lambda ref: ref, None, background=True, stage=stage)
    for b in iter_packed(1, _tensors(1), 100):
        asm.offer(1, b.index, b.num_buckets, b)
    deadline, found = time.monotonic() + 5, None
    while found is None and time.monotonic() < deadline:
        found = asm.poll(0)
        time.sleep(0.01)
    assert found is not None and found[0] == 1
    held = found[1]
    assert all(torch.equal(held[k], v) for k, v in _tensors(1).items())
    assert all(stage.owns(t) for t in held.values())  # views of the staging buffers, not the fetched ones
    made = len(stage.buffers)
    v2 = list(iter_packed(2, _tensors(2), 100))
    for b in v2:  # arrives while the engine still holds version 1's views: the fetch thread waits
        asm.offer(2, b.index, b.num_buckets, b)
    time.sleep(0.3)
    assert all(torch.equal(held[k], v) for k, v in _tensors(1).items())  # untouched while held
    deadline, found = time.monotonic() + 5, None
    while found is None and time.monotonic() < deadline:
        found = asm.poll(1)  # the engine has copied version 1: the buffers are free again
        time.sleep(0.01)
    assert found is not None and found[0] == 2
    assert all(torch.equal(found[1][k], v) for k, v in _tensors(2).items())
    assert len(stage.buffers) == made  # reused, not made again
    asm.close()


def test_a_complete_staged_version_not_yet_taken_is_dropped_when_a_newer_one_overwrites_it():
    asm = BucketAssembler(lambda ref: ref, None, background=False, stage=Staging())
    v1, v2 = list(iter_packed(1, _tensors(1), 100)), list(iter_packed(2, _tensors(2), 100))
    for b in v1:
        asm.offer(1, b.index, b.num_buckets, b)
    asm.offer(2, 0, v2[0].num_buckets, v2[0])  # v1 is complete, untaken; v2 starts in the same buffers
    assert asm.poll(0) is None and asm.stats.dropped_versions == 1  # never a mix of the two
    for b in v2[1:]:
        asm.offer(2, b.index, b.num_buckets, b)
    version, tensors = asm.poll(0)
    assert version == 2 and all(torch.equal(tensors[k], v) for k, v in _tensors(2).items())


def test_publisher_streams_buckets_and_writes_durable_versions(tmp_path):
    objects = {}

    def put(bucket):
        ref = len(objects)
        data = bucket.data.copy()
        data.flags.writeable = False  # the object store's copies are read-only
        objects[ref] = dataclasses.replace(bucket, data=data)
        return ref

    store = WeightStore(str(tmp_path / "w"), keep=5)
    pub = BucketPublisher(100, put, objects.__getitem__, store, durable_every=2)
    workers = [BucketAssembler(objects.__getitem__, None, background=False) for _ in range(2)]
    for version in (1, 2, 3):
        report = pub.publish(version, _tensors(version), [w.receive for w in workers])
        assert report.num_buckets == len(pub.refs) >= 3
        assert report.bytes_moved == 2 * report.bytes_per_worker
        assert report.durable == (version == 2)
        for w in workers:
            got_version, tensors = w.poll(version - 1)
            assert got_version == version
            assert all(torch.equal(tensors[k], v) for k, v in _tensors(version).items())
    assert store.versions() == [2]  # flushed: the background write of v2 committed, manifest last
    loaded = store.load(2)
    assert all(torch.equal(loaded[k], v) for k, v in _tensors(2).items())
    assert len(store.manifest(2).files) == report.num_buckets  # one file per bucket


def test_pack_bucket_makes_its_own_copy():
    t = {"x": torch.ones(4)}
    b = pack_bucket(0, 0, 1, list(t.items()))
    t["x"].add_(1)
    assert np.frombuffer(b.data.tobytes(), dtype=np.float32)[:4].tolist() == [1.0] * 4 and b.nbytes == 64


def test_sync_values_from_liveness_answers():
    """RayRollouts.sync_values: trainer-side figures of the last push; lag and worker-side sync time
    from the live workers' last health answers (a dead worker's and a never-answered one's left out);
    refused weight versions of every worker seen."""
    records = {
        "w0": WorkerRecord("w0", 0.0, health=WorkerHealth(policy_version=5, weight_sync_s=0.2)),
        "w1": WorkerRecord(
            "w1", 0.0, health=WorkerHealth(policy_version=3, weight_sync_s=0.5, weights_refused=1)
        ),
        "w2": WorkerRecord(  # gone: its refusals still count
            "w2", 0.0, health=WorkerHealth(policy_version=0, weight_sync_s=9.0, weights_refused=2)
        ),
        "w3": WorkerRecord("w3", 0.0),  # no answer yet: version -1
    }
    manager = SimpleNamespace(records=records, active_ids=lambda: ["w0", "w1", "w3"])
    fake = SimpleNamespace(
        manager=manager,
        _lags=version_lags(records.values(), 6, {}),  # what check_fleet records at its poll
        _sync_values={"timing/weight_sync_s": 0.1, "weights/sync_bytes": 10},
    )
    values = RayRollouts.sync_values(fake)
    assert values == {
        "timing/weight_sync_s": 0.1,
        "weights/sync_bytes": 10,
        "timing/weight_sync_worker_s": 0.5,
        "weights/version_lag_max": 3,
        "weights/version_lag_mean": 2.0,
        "weights/refused_total": 3,  # every worker seen, a gone one with its last answer
    }


def test_version_lag_counts_each_answer_once_against_its_pings_version():
    """An answer is measured against the trainer's version when its ping went out, and only once: a
    later step (a newer trainer version) does not make an old answer's lag grow."""
    seen: dict[str, float] = {}
    rec = WorkerRecord("w0", 0.0, health=WorkerHealth(policy_version=9))
    rec.last_seen = 1.0
    assert version_lags([rec], 10, seen) == {"w0": 1}
    assert version_lags([rec], 30, seen) == {}  # the same answer, 20 steps later: not counted again
    rec.last_seen, rec.health = 2.0, WorkerHealth(policy_version=31)  # engine moved past the ping's version
    assert version_lags([rec], 30, seen) == {"w0": 0}


def test_the_checksum_covers_the_table_a_bucket_with_a_wrong_table_is_refused():
    named = {"a": torch.arange(12, dtype=torch.float32), "b": torch.ones(4, 2)}
    (bucket,) = list(iter_packed(1, named, 1 << 20))
    name, dtype, shape, offset = bucket.entries[0]
    lying = dataclasses.replace(
        bucket, entries=((name, dtype, (3, 4), offset), *bucket.entries[1:])
    )  # same bytes
    with pytest.raises(ChecksumError):
        unpack_bucket(lying)
    assembler = BucketAssembler(lambda b: b, background=False)
    assembler.offer(1, 0, 1, lying)
    assert assembler.poll(0) is None and assembler.stats.refused_buckets == 1
    assembler.offer(2, 0, 1, dataclasses.replace(bucket, version=2))  # the true table: taken
    assert assembler.poll(1)[0] == 2
