"""WeightStore: publish/load round trip, manifest-last atomicity, checksums, pruning, memory://, errors."""

import hashlib
import json
import threading
import uuid

import fsspec
import numpy as np
import pytest
import torch

from moerl.weights import ChecksumError, StoreNotWritableError, WeightStore
from moerl.weights.store import pack_weights, unpack_weights


def weights(version: int) -> dict[str, torch.Tensor]:
    """Tensors whose values identify the version they were published as."""
    return {
        "embed.weight": torch.full((4, 3), float(version)),
        "layers.0.experts.down_proj": torch.full((2, 3, 5), float(version), dtype=torch.bfloat16),
        "step": torch.tensor(version, dtype=torch.int64),
    }


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://moerl-test-{uuid.uuid4().hex}/weights"


def test_publish_then_load_round_trip(url):
    store = WeightStore(url)
    assert store.latest() is None and store.versions() == []
    published = store.publish(1, weights(1))
    latest = store.latest()
    assert latest == published
    assert latest.version == 1 and latest.uri == f"{url}/v00000001"
    names = {t.name: (t.shape, t.dtype) for t in latest.manifest.tensors}
    assert names == {
        "embed.weight": ((4, 3), "float32"),
        "layers.0.experts.down_proj": ((2, 3, 5), "bfloat16"),
        "step": ((), "int64"),
    }
    loaded = store.load(1)
    assert loaded.keys() == weights(1).keys()
    for name, t in weights(1).items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype


def test_manifest_checksum_is_sha256_of_file(tmp_path):
    store = WeightStore(str(tmp_path))
    v = store.publish(3, weights(3))
    data = (tmp_path / "v00000003" / "model.safetensors").read_bytes()
    (entry,) = v.manifest.files
    assert entry.path == "model.safetensors" and entry.num_bytes == len(data)
    assert entry.sha256 == hashlib.sha256(data).hexdigest()
    on_disk = json.loads((tmp_path / "v00000003" / "manifest.json").read_text())
    assert on_disk["files"][0]["sha256"] == entry.sha256 and on_disk["version"] == 3


def test_version_without_manifest_is_invisible(url):
    store = WeightStore(url)
    store.publish(1, weights(1))
    seen_during_publish = []
    write_manifest = store._write_manifest

    def observe_then_write(version, manifest):
        # the data files of v2 exist now, but its manifest does not: readers must still see v1
        seen_during_publish.append((store.latest().version, store.versions()))
        write_manifest(version, manifest)

    store._write_manifest = observe_then_write
    store.publish(2, weights(2))
    assert seen_during_publish == [(1, [1])]
    assert store.latest().version == 2


def test_crash_before_manifest_leaves_previous_version(url):
    store = WeightStore(url)
    store.publish(1, weights(1))

    def crash(version, manifest):
        raise OSError("simulated crash before the commit point")

    store._write_manifest = crash
    with pytest.raises(OSError, match="simulated crash"):
        store.publish(2, weights(2))
    reader = WeightStore(url)
    assert reader.latest().version == 1 and reader.versions() == [1]
    with pytest.raises(FileNotFoundError, match="weight version 2 not found"):
        reader.load(2)
    reader.publish(2, weights(2))  # a restarted publisher can redo the unfinished version
    assert torch.equal(reader.load(2)["embed.weight"], weights(2)["embed.weight"])


def test_corrupt_file_raises_checksum_error_naming_it(tmp_path):
    store = WeightStore(str(tmp_path), keep=2)
    store.publish(1, weights(1), max_shard_bytes=60)
    files = [f.path for f in store.latest().manifest.files]
    assert len(files) == 3  # 48 B, 60 B and 8 B tensors: one shard each
    victim = tmp_path / "v00000001" / files[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"v00000001/{files[1]}: sha256"):
        store.load(1)


def test_sharded_round_trip_memory_fs():
    url = f"memory://moerl-test-{uuid.uuid4().hex}"
    store = WeightStore(url)
    store.publish(1, weights(1), max_shard_bytes=1)
    assert [f.path for f in store.latest().manifest.files] == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert torch.equal(store.load(1)["layers.0.experts.down_proj"], weights(1)["layers.0.experts.down_proj"])


def test_keeps_last_k_versions(url):
    store = WeightStore(url, keep=2)
    for v in range(1, 6):
        store.publish(v, weights(v))
    assert store.versions() == [4, 5]
    fs, root = fsspec.core.url_to_fs(url)
    assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "v00000004",
        "v00000005",
    ]
    with pytest.raises(FileNotFoundError):
        store.load(3)


def test_readers_only_see_complete_versions_while_publishing(tmp_path):
    store = WeightStore(str(tmp_path), keep=3)
    store.publish(1, weights(1))
    errors, loaded_versions = [], []
    done = threading.Event()

    def read():
        reader = WeightStore(str(tmp_path), keep=3)
        # Read until the writer is done AND at least one load succeeded: on a loaded machine the
        # writer can finish all publishes before this thread first runs.
        while not (done.is_set() and loaded_versions):
            try:
                version, tensors = reader.load_latest()
            except FileNotFoundError:
                continue  # pruned between latest() and load(): allowed, the caller asks again
            except Exception as e:  # noqa: BLE001 - any other error is a failure of the test
                errors.append(repr(e))
                return
            loaded_versions.append(version.version)
            if not torch.equal(tensors["embed.weight"], weights(version.version)["embed.weight"]):
                errors.append(f"v{version.version} has the tensors of another version")

    thread = threading.Thread(target=read)
    thread.start()
    for v in range(2, 12):
        store.publish(v, weights(v))
    done.set()
    thread.join(timeout=10)
    assert errors == [] and loaded_versions
    assert loaded_versions == sorted(loaded_versions)


def test_tied_tensors_and_views_publish(tmp_path):
    base = torch.arange(12.0).reshape(4, 3)
    store = WeightStore(str(tmp_path))
    store.publish(1, {"embed": base, "lm_head": base, "row": base[1]})
    loaded = store.load(1)
    assert torch.equal(loaded["lm_head"], base) and torch.equal(loaded["row"], base[1])


def test_errors(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreNotWritableError, match="a_file/store' cannot be written"):
        WeightStore(str(blocker / "store"))
    with pytest.raises(ValueError, match="keep=0"):
        WeightStore(str(tmp_path), keep=0)
    store = WeightStore(str(tmp_path / "ok"))
    store.publish(2, weights(2))
    with pytest.raises(ValueError, match="version 2 must be > newest stored version 2"):
        store.publish(2, weights(2))
    with pytest.raises(ValueError, match="no tensors"):
        store.publish(3, {})


def test_background_publish_snapshots_commits_in_order_and_reads_its_writes(url):
    store = WeightStore(url, keep=2)
    live = weights(1)
    gate = threading.Event()
    real_write = store._write_files

    def slow_write(*args):  # hold the writer thread until the caller has moved on
        gate.wait(timeout=10)
        return real_write(*args)

    store._write_files = slow_write
    first = store.publish_in_background(1, live)
    store.writer.copies.wait()  # the trainer's fence before its next in-place update (not the write)
    for t in live.values():  # the trainer updates its weights in place while the write is pending
        t.fill_(99)
    second = store.publish_in_background(2, weights(2))
    assert not first.done()  # nothing written yet: the call returned at once
    gate.set()
    assert store.versions() == [1, 2]  # a read waits for the pending writes (read-your-writes)
    assert first.result().version == 1 and second.result().version == 2
    assert float(store.load(1)["embed.weight"][0, 0]) == 1.0  # the copy taken at the call, not 99
    other = WeightStore(url, keep=2)  # a reader in another process sees the same committed versions
    assert other.latest().version == 2 and int(other.load(2)["step"]) == 2


def test_background_publish_error_is_raised_by_the_next_flush_and_commits_nothing(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    store.publish(1, weights(1))

    def crash(*args):
        raise OSError("disk full")

    store._write_manifest = crash
    future = store.publish_in_background(2, weights(2))
    with pytest.raises(OSError, match="disk full"):
        store.flush()
    assert isinstance(future.exception(), OSError)
    store.flush()  # raised once; nothing else pending
    assert store.versions() == [1]
    with pytest.raises(ValueError, match="no tensors"):
        store.publish_in_background(3, {})


def test_pack_weights_round_trip_keeps_names_dtypes_shapes_and_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        **weights(7),
        "odd.bias": torch.tensor([1.5, -2.25, 3.0]),  # 12 bytes: the next tensor starts aligned anyway
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 5),
        "transposed": base.t(),  # not contiguous
        "tied": base,
    }
    packed = pack_weights(tensors)
    assert packed.data.dtype == np.uint8 and all(start % 64 == 0 for *_, start in packed.entries)
    out = unpack_weights(packed)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name
    out["tied"].add_(1)  # writable, and a copy: the source is untouched
    assert float(tensors["tied"][0, 0]) == 0.0 and float(out["tied"][0, 0]) == 1.0


def test_latest_lists_again_when_a_writer_pruned_everything_it_listed(tmp_path, monkeypatch):
    store = WeightStore(str(tmp_path), keep=3)
    for v in (1, 2, 3):
        store.publish(v, weights(v))
    real = store._all_version_dirs
    listings = iter([[97, 98]])  # folders listed, then pruned before their manifests were read

    monkeypatch.setattr(store, "_all_version_dirs", lambda: next(listings, None) or real())
    assert store.latest().version == 3  # not None: versions were published all along
    empty = WeightStore(str(tmp_path / "none"), keep=3)
    assert empty.latest() is None
