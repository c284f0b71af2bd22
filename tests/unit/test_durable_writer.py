"""The weight store's background writer (``moerl.weights.durable``): host snapshots taken at the hand-over,
bounded memory (the caller waits, no version dropped), writes in order, a failed write raised once as one
line, and the run's end waiting for the writer."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from moerl.errors import StorageError, WeightWriteError
from moerl.weights.durable import DurableWriter, HostSnapshot
from moerl.weights.store import WeightStore


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((32, 16), value), "b": torch.full((16,), value), "n": torch.tensor([int(value)])}


class GatedWrites:
    """A ``write`` for ``DurableWriter`` that holds each write until ``gate`` is set; records versions and
    the values it was given."""

    def __init__(self):
        self.gate = threading.Event()
        self.written: list[tuple[int, float]] = []

    def __call__(self, version, tensors, max_shard_bytes):
        assert self.gate.wait(timeout=20)
        self.written.append((version, float(tensors["w"][0, 0])))
        return version


def test_the_snapshot_is_the_handed_over_version_and_its_buffers_are_reused():
    writes = GatedWrites()
    writer = DurableWriter(writes, "mem://x", max_pending=2)
    live = _weights(1.0)
    writer.submit(1, live)
    writer.copies.wait()  # what the trainer does before its next optimizer step
    for t in live.values():  # the trainer steps in place
        t.add_(1)
    writes.gate.set()
    writer.flush()
    assert writes.written == [(1, 1.0)]  # the copy taken at submit, not the stepped tensors
    first = writer._free[0].tensors["w"].data_ptr()
    writer.submit(2, live)
    writer.copies.wait()
    writer.flush()
    assert writes.written[-1] == (2, 2.0)
    assert len(writer._free) == 1 and writer._free[0].tensors["w"].data_ptr() == first  # one buffer, reused


def test_the_hand_over_returns_at_once_and_the_copies_fence_holds_until_the_copy_is_taken(monkeypatch):
    real_take = HostSnapshot.take
    release, taken = threading.Event(), threading.Event()

    def held_take(self, named):  # a loaded host: the copy waits until the test lets it go
        release.wait(timeout=30)
        out = real_take(self, named)
        taken.set()
        return out

    monkeypatch.setattr(HostSnapshot, "take", held_take)
    writes = GatedWrites()
    writes.gate.set()
    writer = DurableWriter(writes, "mem://x")
    live = _weights(1.0)
    writer.submit(1, live)  # returns while the copy is held: the caller went on
    assert not taken.is_set() and not release.is_set()
    fence = threading.Thread(target=writer.copies.wait)
    fence.start()
    fence.join(timeout=0.3)
    assert fence.is_alive()  # the fence holds while the copy is not taken
    release.set()
    fence.join(timeout=30)
    assert not fence.is_alive() and taken.is_set()
    for t in live.values():
        t.add_(1)
    writer.flush()
    assert writes.written == [(1, 1.0)]


def test_at_most_max_pending_versions_wait_and_the_next_hand_over_waits_instead_of_dropping():
    writes = GatedWrites()
    writer = DurableWriter(writes, "mem://x", max_pending=2)
    writer.submit(1, _weights(1.0))
    writer.submit(2, _weights(2.0))  # two pending: both returned at once
    assert writer.num_pending == 2 and writes.written == []
    third = threading.Thread(target=writer.submit, args=(3, _weights(3.0)))
    third.start()
    time.sleep(0.3)
    assert third.is_alive() and writer.num_pending == 2  # the third waits for a free slot
    writes.gate.set()
    third.join(timeout=20)
    writer.flush()
    assert [v for v, _ in writes.written] == [1, 2, 3]  # every version, in order
    assert [x for _, x in writes.written] == [1.0, 2.0, 3.0]
    assert writer.wait_s > 0 and len(writer._free) == 2  # it waited; two host copies at most


def test_a_failed_write_is_raised_once_as_one_line_naming_version_and_store():
    def fail(version, tensors, max_shard_bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = DurableWriter(fail, "s3://bucket/run/weights")
    writer.submit(4, _weights(1.0)).exception(timeout=20)
    with pytest.raises(WeightWriteError) as info:
        writer.check()  # the next step: no waiting, the failure is there
    line = str(info.value)
    assert "\n" not in line and "version 4" in line and "s3://bucket/run/weights" in line
    assert "No space left on device" in line
    assert isinstance(info.value, StorageError) and info.value.errno == errno.ENOSPC  # a full disk stays one
    writer.check()  # raised once
    writer.flush()


def test_the_stores_writer_commits_in_order_and_flush_raises_a_failure(tmp_path):
    store = WeightStore(str(tmp_path / "w"), keep=10, max_pending=1)
    for v in range(3):
        store.publish_in_background(v, _weights(float(v)))
    assert store.versions() == [0, 1, 2]  # a read waits for the writer
    assert [float(store.load(v)["w"][0, 0]) for v in range(3)] == [0.0, 1.0, 2.0]
    real = store._write_manifest
    store._write_manifest = lambda *a: (_ for _ in ()).throw(OSError("bucket gone"))
    store.publish_in_background(3, _weights(3.0))
    with pytest.raises(WeightWriteError, match="background write of version 3 .*OSError: bucket gone"):
        store.flush()  # the run's end
    store._write_manifest = real
    assert store.versions() == [0, 1, 2]  # nothing half-committed
    store.publish_in_background(3, _weights(3.0))
    store.flush()
    assert store.versions() == [0, 1, 2, 3]


def test_store_rejects_a_bad_max_pending(tmp_path):
    with pytest.raises(ValueError, match="max_pending=0"):
        WeightStore(str(tmp_path), max_pending=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: pinned non-blocking copies")
def test_cuda_snapshot_is_pinned_and_ordered_before_later_kernels():
    src = {"w": torch.full((1024, 1024), 1.0, device="cuda")}
    snap = HostSnapshot()
    host = snap.take(src)
    src["w"].add_(1.0)  # queued after the copy on the same stream
    snap.wait()
    assert host["w"].is_pinned() and float(host["w"][0, 0]) == 1.0


def test_the_runs_optimizer_step_waits_for_a_copy_still_being_taken(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from moerl.train import Run

    real_take = HostSnapshot.take

    def slow_take(self, named):  # the copier thread is late (a loaded host)
        time.sleep(0.5)
        return real_take(self, named)

    monkeypatch.setattr(HostSnapshot, "take", slow_take)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    store = WeightStore(str(tmp_path / "w"))
    run = SimpleNamespace(
        trainer=SimpleNamespace(optimizer=torch.optim.AdamW(model.parameters())), store=store
    )
    Run._fence_weights(run)  # what Run does to the trainer it builds
    published = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store.publish_in_background(1, model.state_dict())  # returns before the copy is taken
    model(torch.randn(4, 8)).square().sum().backward()
    run.trainer.optimizer.step()  # in place: must come after the copy
    stored = store.load(1)
    assert not torch.equal(model.weight.detach(), published["weight"])  # the step did change the weights
    assert all(torch.equal(stored[k], t) for k, t in published.items())  # the version as published
