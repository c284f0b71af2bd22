"""Run storage: committed folders (marker last), what readers trust, retries, fetch for a resume."""

import json
from pathlib import Path

import fsspec
import pytest

from moerl.config import load_config
from moerl.rundir.storage import (
    MARKER,
    RunMirror,
    RunStorage,
    StorageError,
    fetch_run,
    is_remote,
    local_model_folder,
    stage_model_folder,
    use_local_storage,
)


@pytest.fixture
def store():
    url = f"memory://moerl-test-{id(object())}"
    yield RunStorage(url, retries=2, backoff_s=0.01)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def _folder(tmp_path: Path, name: str, files: dict[str, bytes]) -> Path:
    folder = tmp_path / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def test_a_folder_is_visible_only_once_its_marker_is_written(store, tmp_path):
    folder = _folder(
        tmp_path, "step_2", {"meta.json": b"{}", "model.safetensors": b"x" * 1000, "sub/a": b"a"}
    )
    store.put_file(
        folder / "model.safetensors", "checkpoints/step_2/model.safetensors"
    )  # an upload cut short
    assert store.committed_files("checkpoints/step_2") is None and store.complete_checkpoints() == []
    store.put_tree(folder, "checkpoints/step_2")
    files = store.committed_files("checkpoints/step_2")
    assert (
        sorted(files) == ["meta.json", "model.safetensors", "sub/a"]
        and files["model.safetensors"]["size"] == 1000
    )
    assert store.complete_checkpoints() == [(2, "checkpoints/step_2")]
    store.get_tree("checkpoints/step_2", tmp_path / "back")
    assert (tmp_path / "back" / "sub" / "a").read_bytes() == b"a"


def test_readers_distrust_damaged_folders(store, tmp_path):
    folder = _folder(tmp_path, "p", {"w.bin": b"w" * 10})
    store.put_tree(folder, "policy")
    store.fs.pipe_file(f"{store.root}/policy/w.bin", b"short")  # a file replaced by a partial one
    assert store.committed_files("policy") is None
    store.fs.pipe_file(f"{store.root}/policy/w.bin", b"v" * 10)  # same size, other bytes
    with pytest.raises(StorageError, match="does not match its sha256"):
        store.get_tree("policy", tmp_path / "back")
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back.part-*"))
    with pytest.raises(FileNotFoundError, match="not a complete folder"):
        store.get_tree("nothing", tmp_path / "none")


def test_failed_uploads_are_retried_then_one_line(store, tmp_path, monkeypatch):
    (tmp_path / "f").write_text("data")
    calls = []
    real = store.fs.put_file

    def flaky(src, dst, **kw):
        calls.append(dst)
        if len(calls) == 1:
            raise ConnectionResetError("connection cut mid-upload")
        return real(src, dst, **kw)

    monkeypatch.setattr(store.fs, "put_file", flaky)
    store.put_file(tmp_path / "f", "a/f")
    assert len(calls) == 2 and store.fs.cat_file(f"{store.root}/a/f") == b"data"
    monkeypatch.setattr(store.fs, "put_file", lambda *a, **k: (_ for _ in ()).throw(OSError("503 Slow Down")))
    with pytest.raises(StorageError) as e:
        store.put_file(tmp_path / "f", "a/g")
    assert "\n" not in str(e.value) and "a/g" in str(e.value) and "after 2 attempts" in str(e.value)


def test_mirror_keeps_the_newest_checkpoints_and_fetch_brings_one_back(store, tmp_path):
    run = tmp_path / "run-1"
    for name in ("config.yaml", "metrics.jsonl", "ledger.jsonl"):
        _folder(run, "", {name: b"x\n"})
    mirror = RunMirror(store, run, keep_checkpoints=2)
    for step in (2, 4, 6):
        _folder(run / "checkpoints", f"step_{step}", {"meta.json": json.dumps({"step": step}).encode()})
        mirror.checkpoint(step)
    assert [s for s, _ in store.complete_checkpoints()] == [4, 6]
    assert not store.exists(f"checkpoints/step_2/{MARKER}")
    local = fetch_run(store.url, tmp_path / "again")
    assert local.name == store.url.rsplit("/", 1)[-1] and (local / "metrics.jsonl").read_bytes() == b"x\n"
    assert [p.name for p in (local / "checkpoints").iterdir()] == ["step_6"]
    with pytest.raises(FileExistsError, match="exists"):
        fetch_run(store.url, tmp_path / "again")
    with pytest.raises(FileNotFoundError, match="not a stored run"):
        fetch_run(store.url + "-missing", tmp_path / "x")


def test_local_and_remote_urls(tmp_path):
    assert is_remote("s3://b/p") and is_remote("memory://x") and not is_remote(str(tmp_path))
    assert not is_remote("file:///tmp/x") and not is_remote(None)
    cfg = load_config(None, [f"storage.url={tmp_path}/runs"])
    use_local_storage(cfg)
    assert cfg.output_dir == f"{tmp_path}/runs" and RunMirror.from_config(cfg, tmp_path / "r") is None
    cfg = load_config(None, ["storage.url=memory://bucket/runs"])
    assert RunMirror.from_config(cfg, tmp_path / "run-7").url == "memory://bucket/runs/run-7"


def test_model_folder_is_staged_beside_a_remote_store_and_copied_back(store, tmp_path):
    folder = _folder(
        tmp_path, "policy", {"config.json": b"{}", "tokenizer.json": b"tok", "model.safetensors": b"w"}
    )
    weights = f"{store.url}/weights"
    assert stage_model_folder(str(folder), str(tmp_path / "local-store")) == str(folder)  # local: unchanged
    assert stage_model_folder(None, weights) is None
    url = stage_model_folder(str(folder), weights)
    assert url == f"{weights}/init" and RunStorage(weights).committed_files("init") is not None
    local = local_model_folder(url)
    assert local != str(folder) and (Path(local) / "tokenizer.json").read_bytes() == b"tok"
    assert local_model_folder(url) == local  # one download per process
    assert local_model_folder(str(folder)) == str(folder)
    with pytest.raises(FileNotFoundError):
        local_model_folder(f"{store.url}/nothing/init")
