"""runtime.weight_sync=cuda_ipc (moerl.weights.ipc) on CPU: the trainer's ring of shared buffers and
an engine in another process (spawned), whole-version switching, acknowledgements, checksums."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from moerl.config import ConfigError, load_config
from moerl.weights.ipc import IpcPublisher, IpcReceiver, _checksum_no_sync, tensors_checksum_no_sync
from moerl.weights.ipc_slots import IpcListener, connect


def _tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "b.weight": torch.randn(16, 8, generator=g),  # 512 bytes
        "a.bias": torch.randn(3, generator=g),
        "c.half": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "d.ids": torch.arange(7, dtype=torch.int64) + version,
    }


def _engine(conn, versions: list[int], out) -> None:
    """Another process: poll like a worker until each version has arrived; report what it received."""
    torch.set_num_threads(1)
    rx = IpcReceiver(conn, "cpu", timeout_s=30)
    params = {k: torch.zeros_like(v) for k, v in _tensors(0).items()}
    seen = []
    while len(seen) < len(versions):
        got = rx.poll(seen[-1] if seen else -1)
        if got is not None:
            for k, t in got[1].items():
                params[k].copy_(t)  # Engine.update_weights
            ok = all(torch.equal(params[k], v) for k, v in _tensors(got[0]).items())
            seen.append(got[0])
            out.put((got[0], ok, rx.stats.last_bytes))
    out.put(("done", rx.stats.versions_applied, len(rx.buffers)))


def test_versions_reach_another_process_through_shared_buffers():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    out = ctx.Queue()
    pub = IpcPublisher(_tensors(0), bucket_bytes=520, num_slots=2, timeout_s=30)
    assert len(pub.plan) >= 3 and len(pub.slots) == 2  # more buckets than slots: the ring is reused
    proc = ctx.Process(target=_engine, args=(child, [1, 2, 3], out), daemon=True)
    proc.start()
    try:
        pub.connect(parent)
        slot_ptrs = [s.data_ptr() for s in pub.slots]
        for v in (1, 2, 3):
            report = pub.publish(v, _tensors(v))
            assert report.num_buckets == len(pub.plan) and report.num_engines == 1
            version, ok, nbytes = out.get(timeout=30)
            assert (version, ok) == (v, True) and nbytes == report.nbytes
        assert out.get(timeout=30) == ("done", 3, len(pub.plan))  # receive buffers allocated once each
        assert [s.data_ptr() for s in pub.slots] == slot_ptrs  # allocated once, reused across versions
        pub.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_engine_keeps_its_weights_when_a_bucket_is_corrupt():
    """In one process (CPU shared memory maps here too): a slot overwritten after its checksum was taken
    drops the version, the fallback is polled instead, and the next good version is taken whole."""
    a, b = mp.Pipe()
    pub = IpcPublisher(_tensors(0), bucket_bytes=520, num_slots=4, timeout_s=5)
    fallback = type("Store", (), {"poll": lambda self, v: ("store", v)})()
    rx = IpcReceiver(b, "cpu", fallback=fallback, timeout_s=5)
    pub.connect(a)
    pub.publish(1, _tensors(1))
    pub.slots[1][0] ^= 1  # bucket 1's slot changes before the engine copies it
    assert rx.poll(0) == ("store", 0)
    assert rx.stats.versions_dropped == 1 and rx.stats.versions_applied == 0
    pub.publish(2, _tensors(2))
    version, tensors = rx.poll(0)
    assert version == 2 and all(torch.equal(tensors[k], v) for k, v in _tensors(2).items())
    assert rx.poll(2) == ("store", 2)  # nothing newer arrived


def test_checksum_wraps_and_sees_one_flipped_bit():
    data = torch.full((64,), 255, dtype=torch.uint8)  # every word is -1: the sum is -8
    assert int(_checksum_no_sync(data)) == -8
    big = torch.tensor([2**62] * 8, dtype=torch.int64).view(torch.uint8)
    assert int(_checksum_no_sync(big)) == 0  # 8 * 2**62 = 2**65 wraps to 0
    flipped = data.clone()
    flipped[17] ^= 4
    assert int(_checksum_no_sync(flipped)) != int(_checksum_no_sync(data))
    odd = [
        torch.arange(5, dtype=torch.uint8),
        torch.tensor([7], dtype=torch.int64),
    ]  # packed: [0..4,0,0,0 | 7]
    assert int(tensors_checksum_no_sync(odd)) == int.from_bytes(bytes(range(5)) + bytes(3), "little") + 7


def test_publish_rejects_other_tensors():
    pub = IpcPublisher(_tensors(0), bucket_bytes=520)
    bad = {**_tensors(1), "b.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="template"):
        pub.publish(1, bad)
    with pytest.raises(ValueError, match="num_slots"):
        IpcPublisher(_tensors(0), 520, num_slots=0)


def test_background_receiver_never_holds_the_trainer_and_gives_the_newest_version():
    """A rollout worker's receiver (background thread, two sets of receive buffers) connected through the
    Unix-socket listener: versions published while the worker does not poll all go through (acked at
    once), and a poll gets the newest whole one; a version taken stays intact while the next arrives."""
    listener = IpcListener()
    rx = IpcReceiver(connect(listener.address, listener.authkey), "cpu", background=True, timeout_s=5)
    pub = IpcPublisher(_tensors(0), bucket_bytes=520, num_slots=2, timeout_s=5)
    deadline = time.monotonic() + 5
    while not (new := listener.take_new()) and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.connect(new[0])
    for v in (1, 2, 3):  # no poll in between: the trainer is not held up (3 buckets > 2 slots)
        pub.publish(v, _tensors(v))
    deadline = time.monotonic() + 5
    got = None
    while (got is None or got[0] < 3) and time.monotonic() < deadline:
        got = rx.poll(0) or got  # version 3 may still be arriving when the trainer is done
        time.sleep(0.01)
    assert got is not None and got[0] == 3
    taken = {k: t.clone() for k, t in got[1].items()}
    pub.publish(4, _tensors(4))  # arrives into the other set while version 3's views are in use
    deadline = time.monotonic() + 5
    while rx._complete is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(torch.equal(got[1][k], taken[k]) for k in taken)
    version, tensors = rx.poll(3)
    assert version == 4 and all(torch.equal(tensors[k], v) for k, v in _tensors(4).items())
    assert rx.poll(4) is None
    pub.close()
    listener.close()


def test_config_cuda_ipc_needs_one_trainer_process():
    assert load_config(None, ["runtime.weight_sync=cuda_ipc"]).runtime.weight_sync == "cuda_ipc"
    with pytest.raises(ConfigError, match="cuda_ipc needs one trainer process"):
        load_config(None, ["runtime.weight_sync=cuda_ipc", "trainer.num_ranks=2"])
