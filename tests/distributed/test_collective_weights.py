"""runtime.weight_sync=collective over gloo, in one process (sender and receivers on threads, each with
its own stateless ProcessGroupGloo): versions arrive whole, a bucket damaged in transit is refused, a
worker admitted late gets the newest version, a lost worker only drops its own group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moerl.weights.buckets import iter_packed
from moerl.weights.collective import (
    CollectiveAddress,
    CollectiveReceiver,
    CollectiveSender,
    WeightTransportError,
    new_group_id,
)


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 16, generator=g),
        "b.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(3, 5, generator=g),
    }


OPENED: list = []
"""Senders and receivers of the running test, closed after it (a failed test leaves no gloo op pending)."""


@pytest.fixture
def address():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = CollectiveAddress("127.0.0.1", master.port, timeout_s=5.0)
    yield addr
    CollectiveSender.tamper = None
    while OPENED:
        OPENED.pop().close()


def _sender(address, admit_every_s=0.0) -> CollectiveSender:
    OPENED.append(sender := CollectiveSender(address, admit_every_s=admit_every_s))
    return sender


def _publish(sender: CollectiveSender, version: int, seed: int, bucket_bytes: int = 300) -> None:
    for bucket in iter_packed(version, _weights(seed), bucket_bytes, reuse=True):
        sender.send(bucket)


def _worker(address, num_ranks=1, fallback=None):
    gid = new_group_id()
    ranks = [CollectiveReceiver(address, gid, r, num_ranks, fallback) for r in range(num_ranks)]
    OPENED.extend(ranks)
    return ranks


def _poll_until(receiver, version, timeout_s=20.0):
    out = []
    _wait(lambda: bool(out.append(receiver.poll(version - 1)) or out[-1]), timeout_s)
    return out[-1]


def test_every_rank_of_a_group_gets_each_whole_version(address):
    sender = _sender(address)
    ranks = _worker(address, num_ranks=2)
    _wait(lambda: sender.admit() or sender.groups)
    assert len(sender.groups) == 1 and all(r.joined.wait(5) for r in ranks)
    for version, seed in ((1, 1), (2, 2)):
        _publish(sender, version, seed)
        for r in ranks:
            got_version, tensors = _poll_until(r, version)
            assert got_version == version
            expected = _weights(seed)
            assert tensors.keys() == expected.keys()
            for name, t in expected.items():
                assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
    assert all(r.stats.versions_applied == 2 and r.stats.refused_buckets == 0 for r in ranks)


def test_an_incomplete_version_is_never_switched_to(address):
    sender = _sender(address)
    (rank,) = _worker(address)
    _wait(lambda: sender.admit() or sender.groups)
    buckets = list(iter_packed(3, _weights(3), 300))
    assert len(buckets) >= 2
    for b in buckets[:-1]:
        sender.send(b)
    time.sleep(0.3)
    assert rank.poll(-1) is None  # all but the last bucket: nothing to switch to
    sender.send(buckets[-1])
    assert _poll_until(rank, 3)[0] == 3


def test_a_bucket_damaged_in_transit_is_refused(address, caplog):
    sender = _sender(address)
    (rank,) = _worker(address)
    _wait(lambda: sender.admit() or sender.groups)
    _publish(sender, 1, 1)
    assert _poll_until(rank, 1)[0] == 1

    def flip_one_byte(bucket):  # after pack_bucket took the checksum: damage on the way
        data = bucket.data.copy()
        if bucket.index == 1:
            data[0] ^= 0xFF
        return data

    CollectiveSender.tamper = staticmethod(flip_one_byte)
    _publish(sender, 2, 2)
    CollectiveSender.tamper = None
    _wait(lambda: rank.stats.refused_buckets == 1)
    time.sleep(0.2)
    assert rank.poll(1) is None  # version 2 is never switched to
    assert "dropped" in caplog.text and "does not match" in caplog.text
    _publish(sender, 3, 3)  # the next whole version is taken
    version, tensors = _poll_until(rank, 3)
    assert version == 3 and torch.equal(tensors["a.weight"], _weights(3)["a.weight"])
    assert rank.stats.versions_applied == 2


def test_a_worker_admitted_late_gets_the_newest_version_at_once(address):
    sender = _sender(address, admit_every_s=0.05)
    _publish(sender, 1, 1)
    _publish(sender, 2, 2)
    (rank,) = _worker(address)  # joins after both publishes; no publish follows
    version, tensors = _poll_until(rank, 2)
    assert version == 2 and torch.equal(tensors["c.bias"], _weights(2)["c.bias"])


def test_a_lost_worker_drops_only_its_group(address):
    sender = _sender(address)
    (kept,) = _worker(address)
    (lost,) = _worker(address)
    _wait(lambda: sender.admit() is not None and len(sender.groups) == 2)
    _wait(lambda: kept.joined.is_set() and lost.joined.is_set())
    lost.close()  # its thread aborts its group: the sender's next broadcast to it fails
    time.sleep(0.2)
    t0 = time.monotonic()
    _publish(sender, 1, 1)
    assert time.monotonic() - t0 < 3 * address.timeout_s  # a failed group never hangs the sender
    assert len(sender.groups) == 1 and len(sender.dropped) == 1
    assert _poll_until(kept, 1)[0] == 1


def test_a_dropped_group_fails_its_receiver(address):
    sender = _sender(address)
    (rank,) = _worker(address)
    _wait(lambda: sender.admit() or sender.groups)
    _wait(rank.joined.is_set)
    sender._drop(sender.groups[0], RuntimeError("test"))
    _wait(lambda: rank.error is not None)
    with pytest.raises(WeightTransportError):
        rank.poll(-1)
