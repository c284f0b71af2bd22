"""`moerl sft` end to end: a shortened warm start must lift held-out greedy exact-match from ~0."""

from pathlib import Path

import pytest

from moerl.cli import main
from moerl.config import load_config
from moerl.models import from_pretrained
from moerl.tasks import load_tokenizer, make_task
from moerl.tasks.eval import evaluate, teacher_forced_exact_match
from moerl.tasks.sft import read_summary

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
# The default model and code path, on a smaller problem space (1-digit operands) and 200 steps so
# that the run is short; the full default run is measured in the issue report.
SHORT = [
    "task.min_digits=1",
    "task.max_digits=1",
    "task.num_eval=50",
    "sft.steps=200",
    "sft.lr=5e-3",
    "sft.num_examples=4000",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "ckpt"
    args = ["sft", "--config", str(DEFAULT), "--out", str(out)]
    for item in SHORT:
        args += ["--set", item]
    assert main(args) == 0
    return out


def test_sft_raises_held_out_accuracy(checkpoint):
    summary = read_summary(checkpoint)
    assert summary.accuracy_before <= 0.1
    assert summary.accuracy_after >= 0.4, summary
    assert summary.steps == 200 and summary.final_loss < 1.0


def test_checkpoint_reloads_with_its_tokenizer_and_same_accuracy(checkpoint):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).is_file(), name
    cfg = load_config(DEFAULT, SHORT)
    model = from_pretrained(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    task = make_task(cfg.task)
    result = evaluate(model, tokenizer, task, max_new_tokens=cfg.rollout.max_new_tokens)
    assert result.accuracy == pytest.approx(read_summary(checkpoint).accuracy_after)
    # for an exact-match task, greedy decoding is correct iff teacher forcing predicts every gold token
    assert teacher_forced_exact_match(model, tokenizer, task.eval_prompts()) == pytest.approx(result.accuracy)
    assert result.num_prompts == len(task.eval_prompts()) and result.num_reward_errors == 0


def test_raising_reward_during_eval_is_counted_not_fatal(checkpoint, tmp_path, monkeypatch):
    (tmp_path / "bad_reward.py").write_text("def fn(prompt, response, answer):\n    raise KeyError(answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(DEFAULT, [*SHORT, "task.reward_fn=bad_reward:fn"])
    task = make_task(cfg.task)
    result = evaluate(from_pretrained(checkpoint), load_tokenizer(checkpoint), task, max_new_tokens=8)
    assert result.accuracy == 0.0 and result.mean_reward == 0.0
    assert result.num_reward_errors == result.num_prompts == task.num_reward_errors > 0
