"""``moerl generate`` end to end on a tiny saved model with the built-in character tokenizer."""

from __future__ import annotations

import json

from _runs import save_fresh_policy

from moerl.cli import main
from moerl.config import ModelConfig
from moerl.models import build_model, save_pretrained
from moerl.tasks import load_tokenizer


def test_generate_cli_writes_one_line_per_sample(tmp_path):
    save_fresh_policy(tmp_path / "m", ModelConfig(max_position_embeddings=64))
    tok = load_tokenizer(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    lines = [{"id": "a", "prompt": "1+2="}, {"prompt": "33-4="}, {"id": "long", "prompt": "9" * 70}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "o.jsonl"
    argv = [
        "generate",
        "--model",
        str(tmp_path / "m"),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "5",
        "--temperature",
        "0.8",
        "-n",
        "2",
        "--max-slots",
        "3",
    ]
    assert main(argv) == 1  # the 70-character prompt does not fit the 64-token context
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("a", 0),
        ("a", 1),
        ("1", 0),
        ("1", 1),
        ("long", 0),
    ]
    for r in rows[:4]:
        assert r["finish_reason"] in ("stop", "length") and r["policy_version"] == 0
        assert len(r["token_ids"]) == len(r["logprobs"]) <= 5 and all(lp <= 0 for lp in r["logprobs"])
        text_ids = r["token_ids"][:-1] if r["finish_reason"] == "stop" else r["token_ids"]
        assert r["completion"] == tok.decode(text_ids)
        assert r["finish_reason"] == "length" or r["token_ids"][-1] == tok.eos_id
    assert rows[4]["finish_reason"] == "error" and "longer than the context" in rows[4]["error"]
    # same seed, same samples
    assert main(argv[:-6] + ["--out", str(tmp_path / "o2.jsonl")] + argv[-6:]) == 1
    assert (tmp_path / "o2.jsonl").read_text() == out.read_text()
    assert (
        main(["generate", "--model", str(tmp_path / "nope"), "--prompts", str(prompts), "--out", str(out)])
        == 2
    )


def test_generate_cli_bad_paths_are_one_line_errors_and_leave_nothing(tmp_path, capsys):
    tok = load_tokenizer(None)
    save_pretrained(build_model(ModelConfig(max_position_embeddings=64), tok.vocab_size), tmp_path / "m")
    tok.save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())
    cases = [
        (
            ["--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(tmp_path / "m")],
            "is a folder",
        ),
        (
            ["--model", str(tmp_path / "nope"), "--prompts", str(prompts), "--out", str(tmp_path / "o")],
            "no such folder",
        ),
        (
            [
                "--model",
                str(tmp_path / "m"),
                "--prompts",
                str(tmp_path / "x.jsonl"),
                "--out",
                str(tmp_path / "o"),
            ],
            "no such file",
        ),
        (
            ["--model", str(tmp_path / "m"), "--prompts", str(empty), "--out", str(tmp_path / "o")],
            "no prompts in it",
        ),
    ]
    for args, message in cases:
        assert main(["generate", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before  # no temp file left in the folder
    assert not (tmp_path / "o").exists()
