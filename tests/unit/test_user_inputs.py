"""Issue 38, the user side: your own model (a transformers Qwen3-MoE with a chat-templated tokenizer),
your data (Parquet of messages) and your reward (a module beside the config, no PYTHONPATH); metrics that
mean what they say; failures that stop a run in one line with a documented exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

import moerl.tasks.eval as eval_mod
from moerl.cli import main
from moerl.config import ConfigError, TaskConfig, load_config
from moerl.errors import EXIT_CONFIG, EXIT_REWARD_FAILED, RewardFunctionError
from moerl.run.reward_errors import RewardErrorWatch
from moerl.tasks import load_tokenizer, make_task
from moerl.tasks.chat import render_chat
from moerl.tasks.datasets import JsonlTask, Record

WORKTREE = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (  # Qwen's ChatML template, shortened
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_chat_tokenizer(folder: Path) -> int:
    """A character BPE (``tokenizers``) with ChatML specials and a chat template; returns its size."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in "\n" + "".join(chr(c) for c in range(32, 127)):
        vocab[ch] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return backend.get_vocab_size(with_added_tokens=True)


def save_qwen3_moe(folder: Path, vocab_size: int) -> None:
    import transformers  # here: slow to import, and only these tests need it

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
    )
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}))


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    """A transformers Qwen3-MoE folder with a chat-templated tokenizer and a generation_config.json."""
    folder = tmp_path_factory.mktemp("qwen3moe")
    save_qwen3_moe(folder, save_chat_tokenizer(folder))
    return folder


# -- metrics that mean what they say --------------------------------------------------------------


def fake_engine(responses: dict[str, str], tokenizer):
    """An engine class whose greedy responses are ``responses[prompt_id]`` (the test fixes what the policy says)."""

    class Engine:
        def __init__(self, *args, **kwargs):
            pass

        def generate(self, requests):
            return [
                SimpleNamespace(request_id=r.request_id, token_ids=tokenizer.encode(responses[r.request_id]))
                for r in requests
            ]

    return Engine


def partial_credit(prompt: str, response: str, answer: str) -> float:
    """0.1 for using the ``####`` format, 1.0 for the right number after it (the issue's reward)."""
    if "####" not in response:
        return 0.0
    return 1.0 if response.split("####")[-1].strip() == answer else 0.1


def test_partial_credit_reward_reports_the_true_exact_match(monkeypatch):
    records = [Record(i + 1, f"What is {i} + 1?", str(i + 1), f"#### {i + 1}") for i in range(100)]
    task = JsonlTask(records, num_eval=10, score_fn=partial_credit)
    held = task.eval_prompts()
    assert len(held) == 10
    # every response uses the format, only the first has the right number
    responses = {p.id: f"#### {p.answer if k == 0 else '0'}" for k, p in enumerate(held)}
    tok = load_tokenizer(None)
    monkeypatch.setattr(eval_mod, "Engine", fake_engine(responses, tok))
    result = eval_mod.evaluate(torch.nn.Linear(1, 1), tok, task)
    assert result.metric == "exact_match"
    assert result.accuracy == pytest.approx(0.1)  # 1 of 10; `score > 0` would have said 1.0
    assert result.mean_reward == pytest.approx((1.0 + 9 * 0.1) / 10)


def test_a_task_without_correctness_reports_the_mean_reward_named_so(monkeypatch):
    records = [Record(i + 1, f"say {i}", None, None) for i in range(20)]
    task = JsonlTask(records, num_eval=2, score_fn=lambda p, r, a: 0.25 * len(r))
    assert not task.has_verifier
    responses = {p.id: "ab" for p in task.eval_prompts()}
    tok = load_tokenizer(None)
    monkeypatch.setattr(eval_mod, "Engine", fake_engine(responses, tok))
    result = eval_mod.evaluate(torch.nn.Linear(1, 1), tok, task)
    assert (result.metric, result.accuracy, result.mean_reward) == ("mean_reward", 0.5, 0.5)
    assert eval_mod.METRIC_NAMES[result.metric] == "mean held-out reward"


# -- prompt formats and datasets --------------------------------------------------------------------


def test_chat_prompts_equal_transformers_apply_chat_template(policy):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(policy)
    tok = load_tokenizer(policy)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(tok.chat_template, messages, tok.special_tokens) == expected
    # a dataset of plain prompts, chat format, system prompt option: the same string
    data = policy.parent / "plain.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is 2+{i}?", "answer": f"#### {2 + i}"}) + "\n" for i in range(4)
        )
    )
    cfg = TaskConfig(name="dataset", path=str(data), prompt_format="chat", system_prompt="Be brief.")
    task = make_task(cfg, None, tok)
    p = next(task.train_prompts(0))
    question = p.text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert p.text == hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
        tokenize=False,
        add_generation_prompt=True,
    )


def test_datasets_in_parquet_and_save_to_disk_folders_read_alike(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"{i}+1", "a": str(i + 1)} for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d_hf"))
    got = []
    for name in ("d.jsonl", "d.parquet", "d_hf"):
        cfg = TaskConfig(
            name="dataset", path=str(tmp_path / name), layout="generic", prompt_field="q", answer_field="a"
        )
        task = make_task(cfg)
        got.append(sorted((p.text, p.answer) for p in task.eval_prompts()))
        assert len(task.eval_prompts()) == 3  # 10% of 30 rows, not num_eval=200 or half
    assert got[0] == got[1] == got[2]


# -- the whole path: a transformers model, parquet messages, a reward beside the config, no PYTHONPATH --


def test_a_run_from_a_transformers_model_on_parquet_messages_with_a_reward_beside_the_config(
    policy, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers

    conf = tmp_path / "conf"
    conf.mkdir()
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i}+1?"},
                {"role": "assistant", "content": f"#### {i + 1}"},
            ]
        }
        for i in range(20)
    ]
    pq.write_table(pa.Table.from_pylist(rows), conf / "train.parquet")
    (conf / "myreward.py").write_text(
        "from moerl.tasks import Reward\n\n"
        "def score(prompt, response, answer):\n"
        "    ok = float(response.strip().endswith(answer))\n"
        "    return Reward(ok + 0.1 * ('####' in response), {'correct': ok})\n"
    )
    config = {
        "output_dir": str(tmp_path / "runs"),
        "model": {"path": str(policy)},
        "sft": {"steps": 0},
        "task": {
            "name": "dataset",
            "path": "PLACEHOLDER",
            "layout": "messages",
            "prompt_format": "chat",
            "system_prompt": "Answer with #### N.",
            "reward_fn": "myreward:score",
        },
        "runtime": {"mode": "sync"},
        "trainer": {"steps": 2, "batch_groups": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 4, "max_slots": 4, "kv_token_budget": 2048},
        "eval": {"every": 0},
    }
    config["task"]["path"] = str(conf / "train.parquet")
    (conf / "run.yaml").write_text(json.dumps(config))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}  # moerl from this tree, myreward only beside the config
    out = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "train", "--config", str(conf / "run.yaml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 rows held out" not in out.stderr and "18 train, 2 held out" in out.stderr  # stated first
    assert "warm start skipped (sft.steps=0)" in out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2 and summary["reward_errors"] == 0
    assert summary["eval_metric"] == "exact_match"
    exported = run / "policy"
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf.chat_template == CHAT_TEMPLATE and hf.unk_token == "<unk>" and hf.eos_token == "<|im_end|>"
    assert json.loads((exported / "generation_config.json").read_text())["temperature"] == 0.7
    transformers.AutoModelForCausalLM.from_pretrained(exported)  # the export loads in transformers


# -- failures: one line, a documented exit code, nothing half-written ---------------------------------


@pytest.fixture
def one_line(tmp_path, monkeypatch, capsys):
    """``one_line(code, *sets)``: ``moerl train`` (sync mode) exits with ``code`` and one line on stderr."""
    monkeypatch.chdir(tmp_path)

    def run(code: int, *sets: str) -> str:
        args = ["train", "--set", f"output_dir={tmp_path / 'runs'}", "--set", "runtime.mode=sync"]
        for s in sets:
            args += ["--set", s]
        capsys.readouterr()  # what the test's own set-up printed
        assert main(args) == code
        err = capsys.readouterr().err
        # a run's progress lines ("[hh:mm:ss] ...") and the dataset's split may come first; then one line
        lines = [
            line for line in err.splitlines() if line.startswith("moerl: ") and "task.path='" not in line[:20]
        ]
        assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, err
        runs = tmp_path / "runs"
        assert not runs.exists() or list(runs.iterdir()) == []  # nothing left behind
        return lines[0]

    return run


SMALL_RUN = (
    "sft.steps=0",
    "trainer.steps=2",
    "trainer.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "rollout.max_slots=4",
    "rollout.kv_token_budget=1024",
)


@pytest.mark.parametrize(
    ("module", "body", "why"),
    [
        ("raising_reward", "raise ValueError('reward service down')", "ValueError: reward service down"),
        ("string_reward", "return '1.0'", "TypeError: reward function returned str"),
    ],
)
def test_a_reward_failing_on_every_sample_of_step_one_stops_the_run(
    one_line, policy, tmp_path, module, body, why
):
    (tmp_path / f"{module}.py").write_text(f"def score(prompt, response, answer):\n    {body}\n")
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(20))
    )
    line = one_line(
        EXIT_REWARD_FAILED,
        f"model.path={policy}",
        "task.name=dataset",
        f"task.path={data}",
        f"task.reward_fn={module}:score",
        *SMALL_RUN,
    )
    assert line.startswith(
        f"moerl: stopped: task.reward_fn='{module}:score' failed on all 4 samples of the first step"
    )
    assert why in line and "nothing was written" in line


def test_a_window_of_failures_stops_the_run_and_a_few_do_not():
    task = JsonlTask([Record(i, str(i), "1", "1") for i in range(1, 11)], score_fn=lambda p, r, a: 1 / 0)
    cfg = TaskConfig(reward_fn="m:f", max_reward_error_fraction=0.5, reward_error_window=3)
    watch = RewardErrorWatch(cfg, task, load_tokenizer(None))

    def batch(errors: int, n: int = 4):
        samples = [
            SimpleNamespace(reward_info={"error": float(i < errors)}, response_ids=(5,)) for i in range(n)
        ]
        return [SimpleNamespace(samples=samples, task=SimpleNamespace(prompt_text="p", answer="1"))]

    watch.observe(batch(3))  # step 1: not every sample failed
    watch.observe(batch(3))  # the window is not full yet
    with pytest.raises(
        RewardFunctionError, match=r"failed on 7 of 12 samples of the last 3 steps .*ZeroDivisionError"
    ):
        watch.observe(batch(1))
    calm = RewardErrorWatch(cfg, task, load_tokenizer(None))
    for _ in range(5):
        calm.observe(batch(2))  # exactly half: not more than the fraction


def test_a_batch_that_can_never_fill_is_refused_at_start(one_line):
    line = one_line(EXIT_CONFIG, "trainer.batch_groups=1000000")  # 1-2 digit + and -: 20000 problems at most
    assert line.startswith("moerl: config error: trainer.batch_groups=1000000 can never fill with distinct")
    assert "at most 13516 training prompts" in line


def test_token_ids_beyond_the_models_vocabulary_are_refused_at_load(one_line, policy, tmp_path):
    small = tmp_path / "small"
    save_qwen3_moe(small, 40)
    save_chat_tokenizer(small)  # 99 ids for a 40-row embedding
    line = one_line(EXIT_CONFIG, f"model.path={small}", *SMALL_RUN)
    assert "token ids but model.path=" in line and "vocab_size=40" in line


def test_a_missing_dataset_names_task_path(one_line):
    line = one_line(EXIT_CONFIG, "task.name=dataset", "task.path=nope.jsonl")
    assert line.startswith("moerl: config error: task.path='nope.jsonl': no such file")


def test_sft_steps_zero_needs_a_policy():
    with pytest.raises(ConfigError, match="sft.steps=0 skips the warm start, but no policy is given"):
        load_config(None, ["sft.steps=0"])
    assert load_config(None, ["sft.steps=0", "init_from=somewhere"]).sft.steps == 0


def test_a_reward_module_beside_the_config_is_found_without_pythonpath(tmp_path, monkeypatch):
    from argparse import Namespace

    from moerl.cli import _config

    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    conf.mkdir(), elsewhere.mkdir()
    (conf / "beside_config_reward.py").write_text("def score(prompt, response, answer):\n    return 0.5\n")
    (conf / "run.yaml").write_text("task: {reward_fn: 'beside_config_reward:score'}\n")
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders it appends go away with the test
    cfg = _config(Namespace(config=str(conf / "run.yaml"), overrides=[]))
    assert cfg.task.import_dirs == (str(conf), str(elsewhere))
    assert make_task(cfg.task).reward("1+1=", "2", "2").score == 0.5


def test_async_mode_without_ray_is_one_line_before_any_work(one_line, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where Ray is not installed
    line = one_line(EXIT_CONFIG, "runtime.mode=async")
    assert "runtime.mode=async" in line and "Ray does not import" in line, line


def test_an_output_dir_that_is_a_file_is_named_in_one_line(one_line, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    line = one_line(EXIT_CONFIG, f"output_dir={afile}")
    assert line == f"moerl: config error: output_dir={str(afile)!r}: {afile} is a file, not a folder", line
    assert afile.read_text() == "mine\n"


def test_an_output_dir_that_cannot_be_created_is_named_in_one_line(one_line):
    """/proc takes no new folders, not even from root: the run's folder cannot be made there."""
    line = one_line(EXIT_CONFIG, "output_dir=/proc/moerl-test-runs")
    assert line.startswith("moerl: config error: output_dir='/proc/moerl-test-runs': cannot create /proc/"), (
        line
    )
    assert line.endswith("(No such file or directory)"), line
