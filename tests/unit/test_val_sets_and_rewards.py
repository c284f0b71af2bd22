"""Issue 51, the data side: validation sets (``task.val_path``, a DatasetDict's ``test`` split), sampled
pass@k / mean@k, reward functions that see the row (``extra=``), batched and timed-out rewards, verl-format
parquet, and config paths resolved beside the config file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.cli import config_line
from moerl.config import ConfigError, load_config, resolve_paths, with_import_dirs
from moerl.records import RolloutTask
from moerl.runtime.queue import TaskQueue
from moerl.tasks import Reward, load_tokenizer, make_task
from moerl.tasks.datasets import JsonlTask, Record, load_records
from moerl.tasks.eval import (
    SAMPLED,
    eval_keys,
    eval_requests,
    eval_values,
    evaluate_sets,
    pass_at_k,
    sample_records,
    score_completions,
)
from moerl.telemetry.metrics import make_record

TOK = load_tokenizer(None)


def verl_row(i: int, split: str = "train") -> dict:
    return {
        "data_source": "unit/add",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i}+1?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": split, "index": i, "tests": [[i, i + 1]]},
    }


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# -- validation sets ------------------------------------------------------------------------------


def test_a_datasetdict_test_split_is_exactly_the_held_out_set(tmp_path, capsys):
    import datasets

    train = [{"prompt": f"train {i}", "answer": str(i)} for i in range(30)]
    test = [{"prompt": f"test {i}", "answer": str(100 + i)} for i in range(7)]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = load_config(None, ["task.name=dataset", f"task.path={tmp_path / 'dd'}", "task.layout=generic"])
    task = make_task(cfg.task)
    held = task.eval_prompts()
    assert [p.answer for p in held] == [r["answer"] for r in test]  # its rows, in order, and only those
    assert list(task.eval_sets()) == ["test"]
    stream = task.train_prompts(0)
    trained = {next(stream).answer for _ in range(60)}  # two epochs of the 30 training rows
    assert trained == {r["answer"] for r in train}  # every train row trains, none of test
    assert "30 rows: 30 train; held out: the 'test' split of task.path=" in task.split_line()
    assert "test (7 rows)" in task.split_line()
    # a DatasetDict whose only split is 'validation' trains on it: its rows are not also the held-out set
    dd_only = datasets.DatasetDict({"validation": datasets.Dataset.from_list(train)})
    dd_only.save_to_disk(str(tmp_path / "only"))
    only = make_task(
        load_config(None, ["task.name=dataset", f"task.path={tmp_path / 'only'}", "task.layout=generic"]).task
    )
    assert list(only.eval_sets()) == ["held_out"] and only.max_train_prompts == 27  # the 10% carve-out


def test_val_path_replaces_the_carve_out_and_names_several_sets(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "easy.jsonl").write_text(json.dumps({"question": "e", "answer": "#### 1"}) + "\n")
    (tmp_path / "hard.jsonl").write_text(
        "".join(json.dumps({"question": f"h{i}", "answer": f"#### {i}"}) + "\n" for i in range(3))
    )
    base = ["task.name=dataset", f"task.path={tmp_path / 'train.jsonl'}"]
    listed = load_config(
        None, [*base, f"task.val_path=[{tmp_path / 'hard.jsonl'}, {tmp_path / 'easy.jsonl'}]"]
    )
    task = make_task(listed.task)
    assert {k: len(v) for k, v in task.eval_sets().items()} == {"hard": 3, "easy": 1}
    assert [p.text for p in task.eval_prompts()] == [p.text for p in task.eval_sets()["hard"]]  # the first
    assert task.max_train_prompts == 40  # nothing carved out
    named = load_config(None, [*base, f"task.val_path={{main: {tmp_path / 'easy.jsonl'}}}"])
    assert list(make_task(named.task).eval_sets()) == ["main"]
    carved = make_task(load_config(None, [*base, "task.num_eval=4"]).task)
    assert carved.max_train_prompts == 36 and list(carved.eval_sets()) == ["held_out"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[a/x.jsonl, b/x.jsonl]", "two sets named alike"),
        ("[]", "task.val_path is empty"),
        ("{'a b': x.jsonl}", "must be letters, digits"),
    ],
)
def test_bad_val_paths_are_one_line_config_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["task.name=dataset", "task.path=t.jsonl", f"task.val_path={value}"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.num_samples=2", "eval.num_samples=2 must be >= eval.k=4"),
        ("eval.temperature=0", "eval.temperature=0.0 is out of range"),
        ("task.reward_timeout_s=0", "task.reward_timeout_s=0.0 is out of range"),
    ],
)
def test_bad_eval_and_reward_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["eval.k=4", override])


# -- verl format and extra= rewards -----------------------------------------------------------------


def test_verl_parquet_loads_as_it_is_with_the_row_as_extra(tmp_path):
    path = write_parquet(tmp_path / "v.parquet", [verl_row(i) for i in range(3)])
    for layout in ("verl", "gsm8k"):  # gsm8k, the default: the verl layout is detected
        records = load_records(path, layout=layout)
        r = records[1]
        assert (r.prompt, r.answer, r.messages[0]["role"]) == ("What is 1+1?", "2", "system")
        assert r.extra == {
            "data_source": "unit/add",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"split": "train", "index": 1, "tests": [[1, 2]]},
        }


def test_an_extra_reward_gets_the_unconsumed_columns_through_the_queue(tmp_path):
    seen = []

    def reward(prompt, response, answer, extra):
        seen.append(extra)
        return float(response == extra["reward_model"]["ground_truth"]) + extra["extra_info"]["index"]

    path = write_parquet(tmp_path / "v.parquet", [verl_row(i) for i in range(10)])
    records = load_records(path)
    task = JsonlTask(records, num_eval=1, score_fn=reward, template="{prompt}")
    queue = TaskQueue(task.train_prompts(0), num_samples=2, tokenize=TOK.encode)
    (lease,) = queue.lease("w0", ttl_s=60.0)
    t = lease.task
    assert t.extra == next(r.extra for r in records if r.answer == t.answer)
    # the queue's state (checkpoints, a drained worker's release) keeps it
    restored = RolloutTask(**json.loads(json.dumps(queue.state_dict()["tasks"][0])))
    assert restored.extra == t.extra
    got = task.reward(t.prompt_text, t.answer, t.answer, t.extra)
    assert got.score == 1.0 + t.extra["extra_info"]["index"] and seen[-1] == t.extra


def test_a_batched_reward_gets_one_call_per_group_and_a_wrong_length_fails_the_batch():
    calls = []

    def batched(prompts, responses, answers, extra):
        calls.append(len(prompts))
        return [
            Reward(float(r == a), {"correct": float(r == a)}) for r, a in zip(responses, answers, strict=True)
        ]

    records = [Record(i + 1, f"q{i}", str(i), str(i), extra={"k": i}) for i in range(10)]
    task = make_task_like(records, batched)
    rewards = task.reward_many(["q"] * 4, ["1", "2", "1", "x"], ["1"] * 4, [{"k": 1}] * 4)
    assert calls == [4] and [r.score for r in rewards] == [1.0, 0.0, 1.0, 0.0]
    short = make_task_like(records, lambda p, r, a: [1.0])
    failed = short.reward_many(["q"] * 3, ["1"] * 3, ["1"] * 3, [None] * 3)
    assert [r.info["error"] for r in failed] == [1.0] * 3 and short.num_reward_errors == 3
    assert "returned 1 values for 3 samples" in short.first_reward_error


def make_task_like(records, fn, **how):
    from moerl.tasks.rewards import RewardFunction

    return JsonlTask(records, num_eval=1, score_fn=RewardFunction.of(fn, batched=True, **how))


def test_a_reward_past_its_timeout_counts_as_failed():
    from moerl.tasks.rewards import RewardFunction

    def slow(prompt, response, answer):
        time.sleep(5 if response == "slow" else 0)
        return 1.0

    records = [Record(i + 1, f"q{i}", str(i), str(i)) for i in range(10)]
    task = JsonlTask(records, num_eval=1, score_fn=RewardFunction.of(slow, timeout_s=0.2))
    fast, late = task.reward_many(["q", "q"], ["fast", "slow"], ["1", "1"], [None, None])
    assert fast == Reward(1.0, {}) and late.info["error"] == 1.0
    assert task.num_reward_errors == 1 and "task.reward_timeout_s=0.2" in task.first_reward_error
    assert "RewardTimeoutError" in task.explain_failure("q", "slow", "1")


# -- sampled eval: pass@k and mean@k ----------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(6, 1, 4) == pytest.approx(1 - 5 / 15)  # 1 - C(5,4)/C(6,4)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(8, 5, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_score_completions_reports_pass_at_k_mean_at_k_and_the_samples():
    prompts = [SimpleNamespace(id=f"p{i}", text=f"q{i}", answer="7", extra=None) for i in range(2)]
    sampling = SimpleNamespace(k=4, n=6, temperature=1.0)
    requests = eval_requests(prompts, TOK, 4, sampling)
    assert [(r.request_id, r.params.n, r.params.temperature) for r in requests] == [
        ("p0", 1, 0.0), (f"p0{SAMPLED}", 6, 1.0), ("p1", 1, 0.0), (f"p1{SAMPLED}", 6, 1.0)
    ]  # fmt: skip
    said = {"p0": "7", f"p0{SAMPLED}": "777x7x", "p1": "1", f"p1{SAMPLED}": "x7xxxx"}  # c = 4 and 1 of 6
    completions = [
        SimpleNamespace(request_id=rid, sample_index=i, token_ids=TOK.encode(ch))
        for rid, text in said.items()
        for i, ch in enumerate(text)
    ]
    task = JsonlTask([Record(i + 1, f"q{i}", "7", "7") for i in range(10)], num_eval=1)
    result = score_completions(prompts, completions, TOK, task, sampling)
    assert result.accuracy == 0.5 and result.k == 4
    assert result.pass_at_k == pytest.approx((1.0 + (1 - 5 / 15)) / 2)
    assert result.mean_at_k == pytest.approx(5 / 12)
    rows = sample_records(result, step=3)
    assert len(rows) == 12 and rows[0] == {
        "step": 3, "set": "held_out", "k": 4, "prompt_id": "p0", "sample_index": 0, "response": "7",
        "reward": 1.0, "correct": 1.0,
    }  # fmt: skip


def test_a_resume_cuts_the_eval_samples_back_to_its_checkpoint(tmp_path):
    from moerl.rundir.folder import RunDir, read_jsonl

    run = RunDir(tmp_path / "run")
    run.eval_samples.write_text("".join(json.dumps({"step": s, "prompt_id": "p"}) + "\n" for s in (0, 2, 4)))
    run.rewind(2)
    assert [r["step"] for r in read_jsonl(run.eval_samples)] == [0, 2]


def test_several_sets_report_per_set_metrics_and_the_first_is_eval_accuracy():
    def fake(prompts):
        acc = len(prompts) / 10
        return SimpleNamespace_result(acc)

    sets = {"gsm": [1, 2], "math": [1, 2, 3]}
    result = evaluate_sets(sets, fake)
    keys = eval_keys(4, list(sets))
    assert keys[:2] == ["eval/pass@4", "eval/mean@4"] and "eval/math/pass@4" in keys
    values = eval_values(result, keys)
    assert values["eval/pass@4"] == 0.2 / 2 and values["eval/gsm/accuracy"] == 0.2
    assert values["eval/math/accuracy"] == pytest.approx(0.3) and values["eval/math/mean@4"] == pytest.approx(
        0.15
    )
    assert eval_values(None, keys) == dict.fromkeys(keys)
    assert eval_keys(0, ["held_out"]) == []
    record = make_record(1, 0.0, {"eval/accuracy": 0.2, **values})
    assert record["eval/math/pass@4"] == pytest.approx(0.15)
    with pytest.raises(KeyError):
        make_record(1, 0.0, {"eval/what": 1.0})


def SimpleNamespace_result(acc):
    from moerl.tasks.eval import EvalResult

    return EvalResult(acc, acc, 1, 1.0, 0, k=4, pass_at_k=acc / 2, mean_at_k=acc / 2)


# -- paths beside the config ------------------------------------------------------------------------


def test_paths_resolve_beside_the_config_then_in_the_working_folder(tmp_path, monkeypatch):
    conf, work = tmp_path / "conf", tmp_path / "work"
    (conf / "data").mkdir(parents=True), work.mkdir()
    (conf / "data" / "train.jsonl").write_text("{}\n")
    (work / "val.jsonl").write_text("{}\n")
    (conf / "val.jsonl").mkdir()  # beside the config wins over the working folder
    monkeypatch.chdir(work)
    cfg = load_config(None, ["task.name=dataset", "task.path=data/train.jsonl", "task.val_path=[val.jsonl]"])
    resolve_paths(cfg, conf / "run.yaml")
    assert cfg.task.path == str(conf / "data" / "train.jsonl")
    assert cfg.task.val_path == (str(conf / "val.jsonl"),)
    cfg = load_config(None, ["task.name=dataset", "task.path=data/train.jsonl", "model.path=/abs/elsewhere"])
    with pytest.raises(ConfigError) as e:  # no config file: the working folder alone
        with_import_dirs(cfg, None)
    assert (
        str(e.value)
        == f"task.path='data/train.jsonl': no such file or folder (tried {work / 'data' / 'train.jsonl'})"
    )
    cfg = load_config(
        None, ["task.name=dataset", f"task.path={conf / 'data' / 'train.jsonl'}", "init_from=nope"]
    )
    with pytest.raises(
        ConfigError,
        match=f"init_from='nope': no such file or folder \\(tried {conf / 'nope'}, {work / 'nope'}\\)",
    ):
        resolve_paths(cfg, conf / "run.yaml")
    assert cfg.model.path is None  # unset fields stay unset


def test_the_first_line_names_the_config_or_the_built_in_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_line("run.yaml") == f"config: {tmp_path / 'run.yaml'}"
    assert config_line(None).endswith(
        f"no configs/default.yaml in {tmp_path}): running the built-in defaults"
    )
