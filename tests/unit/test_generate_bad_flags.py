"""``moerl generate``: bad flags are one-line errors, printed before any model loads or rank spawns."""

from __future__ import annotations

import json

import pytest
import torch
from _runs import DAMAGED_FOLDER_MESSAGES, damage_model_folder, save_fresh_policy

from moerl.cli import main
from moerl.config import ModelConfig
from moerl.ep.parallelize import DISPATCHERS


@pytest.fixture
def paths(tmp_path):
    save_fresh_policy(tmp_path / "m", ModelConfig(max_position_embeddings=64))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    return ["--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),
        (["--max-slots", "0"], "--max-slots=0: must be >= 1"),
        (["--ep-size", "0"], "--ep-size=0: must be >= 1"),
        (["--ep-size", "2", "--ep-ranks-per-node", "0"], "--ep-ranks-per-node=0: must be >= 1"),
        (["--ep-size", "4", "--ep-ranks-per-node", "3"], "--ep-ranks-per-node=3 must divide --ep-size=4"),
        (["--kv-token-budget", "0"], "--kv-token-budget=0: must be >= 1"),
        (["-n", "0"], "-n=0: must be >= 1"),
        (["--ep-dispatcher", "nope"], f"--ep-dispatcher='nope': choose one of {', '.join(DISPATCHERS)}"),
        # the default model has 8 routed experts per MoE layer: 3 ranks cannot share them
        (["--ep-size", "3"], "has 8 routed experts per MoE layer, which must be a positive multiple"),
        (["--device", "nonsense"], "not a torch device"),
        # the engine's rollout.* fields: a flag over the config (moerl.generation.ROLLOUT_FLAGS)
        (["--kv-block-size", "0"], "--kv-block-size=0: must be >= 1"),
        (["--kv-cache", "nope"], "rollout.kv_cache='nope' is not allowed; choose one of ['paged', 'slots']"),
        (
            ["--mla-cache", "nope"],
            "rollout.mla_cache='nope' is not allowed; choose one of ['latent', 'expanded']",
        ),
        (
            ["--weight-dtype", "int4"],
            "rollout.weight_dtype='int4' is not allowed; choose one of ['auto', 'bf16', 'fp8']",
        ),
        (["--weight-dtype", "fp8", "--ep-size", "2"], "--weight-dtype fp8 runs one engine"),
        (["--config", "nope.yaml"], "nope.yaml"),
        (["--set", "rollout.max_slots=0"], "rollout.max_slots=0"),
    ],
)
def test_bad_flags_are_one_line_errors(paths, capsys, tmp_path, flags, message):
    assert main(["generate", *paths, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a machine without a usable GPU")
def test_cuda_without_a_gpu_is_one_line(paths, capsys):
    assert main(["generate", *paths, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moerl generate: error: --device cuda: ") and len(err.splitlines()) == 1, err


def test_prompts_folder_is_named_a_folder(paths, capsys, tmp_path):
    paths[3] = str(tmp_path)
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--prompts {tmp_path} is a folder" in err and len(err.splitlines()) == 1, err


def test_max_new_tokens_one_is_honoured(paths, tmp_path):
    assert main(["generate", *paths, "--max-new-tokens", "1"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [1]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "1+2="}\n\xff\n', ":2: not UTF-8 text (invalid start byte at byte 1)"),
        (b'{"prompt": "1+2=", "id": [1]}\n', ":1: field 'id' must be a string or an integer, got [1]"),
        (b'{"prompt": "1+2="\n', ":1: not valid JSON (Expecting ',' delimiter at column 1)"),
        (b"[1, 2]\n", ":1: expected a JSON object, got list"),
    ],
)
def test_bad_prompts_file_is_one_line_naming_file_and_line(paths, capsys, tmp_path, content, message):
    (tmp_path / "p.jsonl").write_bytes(content)
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moerl generate: error: {tmp_path / 'p.jsonl'}{message}", err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    ("kind", "message"),
    DAMAGED_FOLDER_MESSAGES,
)
def test_a_damaged_model_folder_is_one_line_naming_the_file(paths, capsys, tmp_path, kind, message):
    damage_model_folder(tmp_path / "m", kind)
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moerl generate: error: --model {tmp_path / 'm'}: {tmp_path / 'm'}/{message}"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()


def test_a_model_folder_without_tokenizer_says_how_to_give_one(paths, capsys, tmp_path):
    (tmp_path / "m" / "tokenizer.json").unlink()
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"moerl generate: error: --model {tmp_path / 'm'}: no tokenizer.json in the folder; pass --tokenizer "
        "PATH (moerl train uses the built-in character tokenizer for such a folder and says so)"
    )


def test_no_model_and_no_config_model_path_is_one_line(paths, capsys, tmp_path):
    assert main(["generate", *paths[2:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "moerl generate: error: --model is required (a Hugging Face model folder), or model.path in --config"
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_a_row_with_neither_prompt_nor_messages_names_its_line(paths, capsys, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+2="}\n{"text": "3+4="}\n')
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"moerl generate: error: {tmp_path / 'p.jsonl'}:2: expected an object with a string 'prompt' field "
        "or a 'messages' list"
    ), err


def test_a_cache_beyond_the_memory_is_refused_before_the_model_loads(paths, capsys, tmp_path, monkeypatch):
    import moerl.rollout.memory_check as memory_check

    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: (64 << 10, "a 64 KiB host"))
    assert main(["generate", *paths, "--max-slots", "48", "--kv-token-budget", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "moerl generate: error: rollout.max_slots=48, rollout.kv_token_budget=4096: the run needs about"
        )
        and "1 rollout engine KV cache(s)" in err
        and len(err.splitlines()) == 1
    ), err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_run_folder_as_model_names_its_exported_policy(paths, capsys, tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    paths[1] = str(run)
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a moerl run folder, not a model folder: it has no exported policy yet" in err, err
    (run / "policy").mkdir()
    assert main(["generate", *paths]) == 2
    err = capsys.readouterr().err.strip()
    assert f"its exported policy is {run / 'policy'}" in err and len(err.splitlines()) == 1, err
