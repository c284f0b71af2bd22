"""A short sync run from an FP8 release (``init_from`` in the DeepSeek-V3 format, dequantized for training)
with FP8 rollout (``rollout.weight_dtype=fp8``): the log-prob gap and greedy agreement reach metrics.jsonl."""

import math

import torch
from _runs import newest_run
from conftest import TINY_MODEL, short_config

from moerl.config import load_config
from moerl.models import build_model
from moerl.models.fp8_checkpoint import save_fp8_release
from moerl.run.folder import read_jsonl
from moerl.tasks import load_tokenizer
from moerl.train import train


def test_sync_run_from_an_fp8_release_reports_the_fp8_gap(tmp_path):
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    init = tmp_path / "release"
    save_fp8_release(build_model(load_config(None, TINY_MODEL).model, tok.vocab_size), init)
    tok.save(init)
    cfg = short_config(
        tmp_path, init, "trainer.steps=2", "rollout.weight_dtype=fp8", "task.reward_fn=e2e_rewards:first_is_digit"
    )
    summary = train(cfg, live=False)
    rows = read_jsonl(newest_run(cfg).metrics)
    assert len(rows) == 2 and summary["tasks_lost"] == 0
    for r in rows:
        assert 0 < r["rollout/fp8_logprob_gap_mean"] <= r["rollout/fp8_logprob_gap_max"] < 1.0
        assert 0.5 <= r["rollout/fp8_greedy_agreement"] <= 1.0
        assert math.isfinite(r["train/rollout_logprob_abs_diff"]) and r["train/rollout_logprob_abs_diff"] > 0
