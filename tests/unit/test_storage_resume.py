"""A resume from storage: the SFT warm start is stored once and fetched back (no second warm start on
another machine), and a remote resume that fails before training leaves no fetched folder behind."""

from __future__ import annotations

import fsspec
import pytest
import torch

from moerl.config import ConfigError, RunConfig
from moerl.rundir.folder import RunDir
from moerl.rundir.storage import MARKER, RunMirror, RunStorage, fetch_run
from moerl.train import resume
from moerl.trainer.checkpoint import save_checkpoint


@pytest.fixture
def store():
    url = f"memory://moerl-resume-{id(object())}/runs/run-1"
    yield RunStorage(url, retries=1, backoff_s=0.01)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def _stored_run(tmp_path, store, **cfg) -> RunMirror:
    run = RunDir.create(RunConfig(output_dir=str(tmp_path / "a"), **cfg))
    mirror = RunMirror(store, run.path)
    save_checkpoint(run.path, 2, {"model": {"w": torch.zeros(2)}, "trainer": {"step": 2}})
    mirror.checkpoint(2)
    return mirror


def test_the_sft_warm_start_is_stored_once_and_fetched_for_a_resume(tmp_path, store):
    mirror = _stored_run(tmp_path, store)
    sft = mirror.run_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text("{}")
    (sft / "model.safetensors").write_bytes(b"w" * 100)
    mirror.warm_start(sft)
    assert sorted(store.committed_files("sft")) == ["config.json", "model.safetensors"]
    committed = store.fs.cat_file(f"{store.root}/sft/{MARKER}")
    mirror.warm_start(sft)  # a resumed run: already there, not uploaded again
    assert store.fs.cat_file(f"{store.root}/sft/{MARKER}") == committed
    local = fetch_run(store.url, tmp_path / "b")
    assert (local / "sft" / "model.safetensors").read_bytes() == b"w" * 100
    assert [p.name for p in (local / "checkpoints").iterdir()] == ["step_2"]


def test_a_failed_remote_resume_removes_what_it_fetched(tmp_path, store):
    _stored_run(tmp_path, store, init_from="models/moved-away")
    with pytest.raises(ConfigError) as e:
        resume(store.url, [f"output_dir={tmp_path / 'b'}"], live=False)
    assert "\n" not in str(e.value) and str(e.value).startswith("init_from='models/moved-away' (from ")
    assert "--set init_from=PATH" in str(e.value)
    assert list((tmp_path / "b").iterdir()) == []  # no half-used copy of the run left behind
    with pytest.raises(ConfigError, match="--set model.hidden_size: a resumed run keeps its own config"):
        resume(store.url, [f"output_dir={tmp_path / 'b'}", "model.hidden_size=128"], live=False)
    assert list((tmp_path / "b").iterdir()) == []


def test_a_stored_relative_init_from_is_found_from_the_folder_the_run_started_in(tmp_path, monkeypatch):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "models" / "init").mkdir(parents=True)
    (start / "models" / "init" / "config.json").write_text("{}")
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    run = RunDir.create(RunConfig(output_dir="runs", init_from="models/init"))  # as stored before: relative
    path = run.path.resolve()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):  # past the init_from check
        resume(path, live=False)
    with pytest.raises(
        ConfigError, match=r"init_from='models/init2' \(from --set\) .*relative to .*elsewhere"
    ):
        resume(path, ["init_from=models/init2"], live=False)  # a --set one: from here
