"""``moerl sft --out``: replaces only a folder that ``moerl sft`` wrote, never one with the user's files."""

from __future__ import annotations

import pytest

import moerl.tasks.sft as sft
from moerl.cli import main
from moerl.tasks.sft import is_sft_file

SFT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "sft_summary.json",
)
"""The files of a one-shard ``moerl sft`` output."""


@pytest.fixture
def sft_calls(monkeypatch, tmp_path):
    """``run_sft`` replaced by a recorder: the check under test runs, no training."""
    calls = []
    monkeypatch.setattr(sft, "run_sft", lambda cfg, out_dir, progress=None: calls.append(out_dir))
    monkeypatch.chdir(tmp_path)
    return calls


def _folder(path, *names: str):
    path.mkdir()
    for name in names:
        (path / name).write_text("{}")
    return path


def _snapshot(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in path.rglob("*")}


def test_an_earlier_sft_output_is_replaced(tmp_path, sft_calls):
    one = _folder(tmp_path / "one", *SFT_FILES)
    sharded = _folder(
        tmp_path / "sharded",
        *(f for f in SFT_FILES if f != "model.safetensors"),
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    )
    assert main(["sft", "--out", str(one), "--set", "sft.steps=1"]) == 0
    assert main(["sft", "--out", str(sharded), "--set", "sft.steps=1"]) == 0
    assert sft_calls == [str(one), str(sharded)]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (("notes.txt",), "notes.txt is not one of its files"),  # the user's notes in a copied sft output
        (("sub/",), "sub is not one of its files"),  # a sub-folder
        (("mydata.bin", "notes.txt"), "mydata.bin is not one of its files"),  # the first one, sorted
    ],
)
def test_an_sft_output_with_added_files_is_refused(tmp_path, sft_calls, capsys, extra, named):
    out = _folder(tmp_path / "sft3", *SFT_FILES)
    for name in extra:
        (out / name).mkdir() if name.endswith("/") else (out / name).write_text("important")
    before = _snapshot(out)
    assert main(["sft", "--out", str(out), "--set", "sft.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and named in err
    assert "exists and is not a model folder" in err
    assert _snapshot(out) == before and sft_calls == []


@pytest.mark.parametrize(
    ("names", "named"),
    [
        (("config.json", "mydata.bin"), "mydata.bin is not one of its files"),
        (("config.json",), "no sft_summary.json"),
        (("config.json", "model.safetensors", "tokenizer.json"), "no sft_summary.json"),  # a model folder
        (("config.json", "model.safetensors", "README.md", "generation_config.json"), "README.md"),  # from HF
    ],
)
def test_a_folder_moerl_sft_did_not_write_is_refused(tmp_path, sft_calls, capsys, names, named):
    out = _folder(tmp_path / "model", *names)
    before = _snapshot(out)
    assert main(["sft", "--out", str(out), "--set", "sft.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and named in err
    assert _snapshot(out) == before and sft_calls == []


def test_is_sft_file_knows_the_files_run_sft_writes():
    assert all(is_sft_file(f) for f in (*SFT_FILES, "model.safetensors.index.json"))
    assert is_sft_file("model-00003-of-00012.safetensors")
    assert not any(
        is_sft_file(f)
        for f in ("notes.txt", "model-1-of-2.safetensors", "pytorch_model.bin", ".gitattributes")
    )


def test_sigterm_stops_sft_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    import os
    import signal

    def terminated(cfg, out_dir, progress=None):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stopping the job would
        signal.pause()  # not reached: the handler raises on delivery

    monkeypatch.setattr(sft, "run_sft", terminated)
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["sft", "--set", "sft.steps=1", "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip().endswith("moerl: interrupted")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the command's only
