"""WeightStore.publish_buckets: the same version format as publish, one file per bucket, at most one held."""

import pytest
import torch

from moerl.weights.store import WeightStore


def _tensors():
    torch.manual_seed(0)
    return {f"w{i}": torch.randn(3, i + 1) for i in range(5)}


def test_buckets_publish_a_version_readers_load_like_publish(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    plan = [names[:2], names[2:3], names[3:]]
    taken = []

    def buckets():
        for chunk in plan:
            taken.append(len(taken))  # consumed lazily, one bucket at a time
            yield [(n, tensors[n]) for n in chunk]

    store = WeightStore(str(tmp_path / "a"))
    version = store.publish_buckets(1, buckets(), num_buckets=3)
    assert [f.path for f in version.manifest.files] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    loaded = store.load(1)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    plain = WeightStore(str(tmp_path / "b")).publish(1, tensors, max_shard_bytes=1)
    assert [t.name for t in plain.manifest.tensors] == [t.name for t in version.manifest.tensors]


def test_bad_buckets_commit_nothing(tmp_path):
    store = WeightStore(str(tmp_path))
    t = _tensors()
    with pytest.raises(ValueError, match="sorted by name"):
        store.publish_buckets(1, iter([[("w1", t["w1"])], [("w0", t["w0"])]]), num_buckets=2)
    with pytest.raises(ValueError, match="expected 3"):
        store.publish_buckets(1, iter([[("w0", t["w0"])]]), num_buckets=3)
    assert store.versions() == []


def test_packed_nbytes_is_what_the_buckets_hold_before_packing():
    from moerl.weights.buckets import iter_packed, packed_nbytes

    named = {
        "a": torch.zeros(33, dtype=torch.float32),  # 132 bytes: padded to 192
        "b": torch.zeros(5, 7, dtype=torch.bfloat16),
        "c": torch.zeros(1000, dtype=torch.float32),
        "d": torch.zeros((), dtype=torch.int64),
    }
    for bucket_bytes in (64, 1000, 10**6):
        packed = sum(b.nbytes for b in iter_packed(1, named, bucket_bytes))
        assert packed_nbytes(named, bucket_bytes) == packed, bucket_bytes
