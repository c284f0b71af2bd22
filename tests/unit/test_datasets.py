"""JSONL loaders and numeric answer matching: GSM8K (real file when present), generic layout, bad input."""

import json
from fractions import Fraction
from pathlib import Path

import pytest

from moerl.config import TaskConfig
from moerl.tasks import DatasetError, JsonlTask, load_jsonl, make_task
from moerl.tasks.answers import answers_match, extract_answer, format_number

GSM8K = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


def write(tmp_path, text, name="data.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,234", Fraction(1234)),
        ("-3.50 kg.", Fraction(-7, 2)),
        ("\u22127", Fraction(-7)),  # Unicode minus
        ("+5", Fraction(5)),
        ("$18", Fraction(18)),
        ("18 dollars.", Fraction(18)),
        ("The answer is 18.", Fraction(18)),
        ("16 - 3 - 4 = 9 eggs\n#### 9", Fraction(9)),
        ("so 3+4=7, and 7*2=14 in total", Fraction(14)),
        (r"the result is \boxed{1,000} (not 999)", Fraction(1000)),
        (r"\boxed{\frac{1}{2}}", Fraction(1, 2)),
        ("0.5", Fraction(1, 2)),
        ("12-5", Fraction(5)),  # a minus between numbers is not a sign
        ("no number here", None),
    ],
)
def test_extract_answer(text, value):
    assert extract_answer(text) == value


def test_answers_match_and_format():
    assert answers_match("It is 3.50", "3.5")
    assert answers_match("#### 1,000", "1000")
    assert not answers_match("1001", "1000")
    assert not answers_match("anything", "no number")
    assert format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "1/3"
    assert format_number(Fraction(-46)) == "-46"


def test_gsm8k_layout_small(tmp_path):
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i}+1=<<{i}+1={i + 1}>>{i + 1}\n#### {i + 1:,}"}
        for i in range(998, 1038)
    ]
    path = write(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = load_jsonl(path)
    assert [r.line for r in records] == list(range(1, 41))  # 40 rows: 10% is the 4 held out
    assert records[0].answer == "999" and records[2].answer == "1001"  # "1,001" normalized
    task = JsonlTask(records, name="toy", num_eval=4)
    evals, train = task.eval_prompts(), [next(iter_) for iter_ in [task.train_prompts(0)] for _ in range(8)]
    assert len(evals) == 4 and len({p.id for p in train}) == 8
    assert not {p.id for p in evals} & {p.id for p in train}
    p = evals[0]
    assert p.text.startswith("Question: What is ") and p.text.endswith("\nAnswer:")
    assert task.reward(p.text, p.solution, p.answer).score == 1.0


def test_a_repeated_prompt_is_held_out_with_all_its_rows(tmp_path):
    """60 rows of 5 distinct prompts: the split is over the prompts, so no held-out prompt is trained on,
    and a batch can hold as many groups as there are distinct training prompts."""
    rows = [{"question": f"What is {i % 5} + 1?", "answer": f"#### {i % 5 + 1}"} for i in range(60)]
    task = JsonlTask(
        load_jsonl(write(tmp_path, "\n".join(json.dumps(r) for r in rows))), name="dup", num_eval=200
    )
    held = {p.text for p in task.eval_prompts()}
    trained = {p.text for p in _take(task.train_prompts(0), 200)}
    assert len(held) == 1 and len(task.eval_prompts()) == 1 and not held & trained
    assert task.max_train_prompts == len(trained) == 4
    assert "60 rows: 48 train, 12 held out" in task.split_line() and "5 distinct prompts" in task.split_line()


def test_generic_layout_custom_fields(tmp_path):
    path = write(tmp_path, '{"q": "2+2", "a": 4}\n{"q": "3+3", "a": "6"}\n')
    task = make_task(
        TaskConfig(
            name="jsonl",
            path=str(path),
            layout="generic",
            prompt_field="q",
            answer_field="a",
            template="Q: {prompt}\nA:",
        )
    )
    prompts = task.eval_prompts() + [next(task.train_prompts(0))]
    assert sorted(p.answer for p in prompts) == ["4", "6"]
    assert all(p.text.startswith("Q: ") for p in prompts)
    assert task.reward("", "the answer is 4.", "4").score == 1.0


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"question": "q", "answer": "#### 1"}\n{not json}\n', 2, "not valid JSON"),
        ('{"question": "q", "answer": "#### 1"}\n\n{"question": "q"}\n', 3, "missing field 'answer'"),
        ('{"answer": "#### 1"}\n', 1, "missing field 'question'"),
        ("[1, 2]\n", 1, "expected a JSON object"),
        ('{"question": "q", "answer": "no final answer"}\n', 1, "no '#### <number>'"),
        ('{"question": "q", "answer": "#### none"}\n', 1, "no number after '####'"),
        ('{"question": ["q"], "answer": "#### 1"}\n', 1, "must be a string or number"),
        ("", 1, "no records"),
        ("\n  \n", 2, "no records"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(DatasetError, match=message) as err:
        load_jsonl(path)
    assert str(err.value).startswith(f"{path}:{line}:")


def test_missing_file_and_generic_missing_field(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "absent.jsonl")
    path = write(tmp_path, '{"prompt": "x"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:1: missing field 'answer'"):
        load_jsonl(path, layout="generic")


@pytest.mark.skipif(not GSM8K.is_file(), reason="GSM8K test set not present at ../shared/data/gsm8k")
def test_gsm8k_real_file_gold_scores_one_wrong_scores_zero():
    task = make_task(TaskConfig(name="jsonl", path=str(GSM8K), layout="gsm8k"))
    records = load_jsonl(GSM8K)
    assert len(records) == 1319
    prompts = task.eval_prompts() + list(
        _take(task.train_prompts(0), len(records) - len(task.eval_prompts()))
    )
    assert len({p.id for p in prompts}) == len(records)
    for p in prompts:
        gold = Fraction(p.answer)
        assert task.reward(p.text, p.solution, p.answer).score == 1.0, p.id  # worked solution with ####
        assert task.reward(p.text, p.answer, p.answer).score == 1.0, p.id  # the bare number
        assert task.reward(p.text, f"The answer is {format_number(gold + 1)}.", p.answer).score == 0.0, p.id
    assert task.num_reward_errors == 0


def _take(iterator, n):
    for _ in range(n):
        yield next(iterator)


def test_a_numpy_scalar_reward_is_a_number_and_a_string_is_not():
    import numpy as np

    from moerl.tasks.base import as_reward

    assert as_reward(np.float32(0.5)).score == 0.5 and as_reward(True).score == 1.0
    with pytest.raises(TypeError, match="returned str"):
        as_reward("1.0")


def test_an_export_without_a_generation_config_gets_one_that_stops_at_eos(tmp_path):
    from moerl.tasks.sft import save_tokenizer_and_companions
    from moerl.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer()
    save_tokenizer_and_companions(tok, None, tmp_path / "fresh")
    gen = json.loads((tmp_path / "fresh" / "generation_config.json").read_text())
    assert gen == {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    src = tmp_path / "src"
    src.mkdir()
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "temperature": 0.6}))
    save_tokenizer_and_companions(tok, str(src), tmp_path / "kept")  # the model's own is kept as it came
    assert json.loads((tmp_path / "kept" / "generation_config.json").read_text())["temperature"] == 0.6
