"""``WeightSnapshot`` (``runtime.overlap_publish``): the version sent is the one copied at publish time,
whatever the trainer does to its own tensors while the send is under way."""

from __future__ import annotations

import torch

from moerl.weights.buckets import unpack_bucket
from moerl.weights.snapshot import WeightSnapshot
from moerl.weights.store import WeightStore


class ListSink:
    """A ``BucketSink`` that keeps each packed bucket's tensors (copied: the staging buffer is reused)."""

    def __init__(self):
        self.tensors = {}

    def send(self, bucket):
        self.tensors.update({n: t.clone() for n, t in unpack_bucket(bucket)})
        return bucket.index


def test_the_snapshot_sends_the_weights_of_its_version_not_later_updates(tmp_path):
    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    snap = WeightSnapshot(7, weights)
    want = {n: t.clone() for n, t in weights.items()}
    for t in weights.values():  # the trainer's next step, in place
        t.add_(100.0)
    assert all(torch.equal(snap.named_weights()[n], want[n]) for n in want)
    version = snap.publish(WeightStore(str(tmp_path / "w")))
    loaded = WeightStore(str(tmp_path / "w")).load_latest()
    assert version.version == loaded[0].version == 7
    assert all(torch.equal(loaded[1][n], want[n]) for n in want)
    sink = ListSink()
    with snap.stream_context():  # on CPU: nothing to wait for
        streamed = snap.stream_buckets(sink, bucket_bytes=32)
    assert streamed.version == 7 and len(streamed.refs) > 1
    assert all(torch.equal(sink.tensors[n], want[n]) for n in want)
