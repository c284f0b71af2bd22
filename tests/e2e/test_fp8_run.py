"""A short sync run from an FP8 release (``init_from`` in the DeepSeek-V3 format, dequantized for training)
with FP8 rollout (``rollout.weight_dtype=fp8``): the log-prob gap and greedy agreement reach metrics.jsonl."""

import json
import math

import pytest
import torch
from _runs import newest_run
from conftest import TINY_MODEL, short_config

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.models import build_model
from moerl.models.fp8_checkpoint import save_fp8_release
from moerl.rundir.folder import read_jsonl
from moerl.tasks import load_tokenizer
from moerl.train import train


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The e2e tiny policy written in the FP8 release format, with the built-in tokenizer."""
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    init = tmp_path_factory.mktemp("fp8") / "release"
    save_fp8_release(build_model(load_config(None, TINY_MODEL).model, tok.vocab_size), init)
    tok.save(init)
    return init


def test_generate_reads_an_fp8_release(release, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "12+34="}) + "\n")
    texts = {}
    for weights in ("auto", "fp8"):
        out = tmp_path / f"{weights}.jsonl"
        argv = ["generate", "--model", str(release), "--prompts", str(prompts), "--out", str(out),
                "--max-new-tokens", "6", "--weight-dtype", weights]  # fmt: skip
        assert cli_main(argv) == 0
        row = json.loads(out.read_text())
        texts[weights] = (row["token_ids"], row["logprobs"])
    # experts 32 wide: the FP8 model quantizes gate and up again as one stacked block (the release's
    # per-expert blocks do not stack), so the two differ by that rounding only
    assert texts["auto"][0] == texts["fp8"][0] and len(texts["fp8"][0]) == 6
    assert texts["auto"][1] == pytest.approx(texts["fp8"][1], abs=1e-3)
    assert cli_main([*argv[:-1], "int4"]) == 2


def test_sync_run_from_an_fp8_release_reports_the_fp8_gap(release, tmp_path):
    init = release
    cfg = short_config(
        tmp_path,
        init,
        "trainer.steps=2",
        "rollout.weight_dtype=fp8",
        "task.reward_fn=e2e_rewards:first_is_digit",
    )
    summary = train(cfg, live=False)
    rows = read_jsonl(newest_run(cfg).metrics)
    assert len(rows) == 2 and summary["tasks_lost"] == 0
    for r in rows:
        assert 0 < r["rollout/fp8_logprob_gap_mean"] <= r["rollout/fp8_logprob_gap_max"] < 1.0
        assert 0.5 <= r["rollout/fp8_greedy_agreement"] <= 1.0
        assert math.isfinite(r["train/rollout_logprob_abs_diff"]) and r["train/rollout_logprob_abs_diff"] > 0
