"""``moerl generate --ep-size 2`` (two gloo processes, experts sharded) writes the ep_size=1 samples."""

import json

import pytest
import torch

from moerl.cli import main
from moerl.config import ModelConfig
from moerl.models import build_model, save_pretrained
from moerl.tasks import load_tokenizer


@pytest.mark.timeout(300)
def test_generate_ep_size_2_matches_one_engine(tmp_path):
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    cfg = ModelConfig(max_position_embeddings=64, num_experts=4, top_k=2)
    save_pretrained(build_model(cfg, tok.vocab_size), tmp_path / "m")
    tok.save(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"id": "a", "prompt": "1+2="},
        {"prompt": "33-4="},
        {"prompt": "5*6="},
        {"id": "long", "prompt": "9" * 70},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = {}
    for ep in ("1", "2"):
        out = tmp_path / f"o{ep}.jsonl"
        argv = ["generate", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out", str(out)]
        argv += ["--max-new-tokens", "6", "-n", "2", "--max-slots", "4", "--ep-size", ep]
        assert main(argv) == 1  # the 'long' prompt cannot be served either way
        rows[ep] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample_index"]) for r in rows["2"]] == [
        (r["id"], r["sample_index"]) for r in rows["1"]
    ]
    for a, b in zip(rows["1"], rows["2"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert rows["2"][-1]["finish_reason"] == "error"
