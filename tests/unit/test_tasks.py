"""Task interface, arithmetic task, user reward functions by import path, make_task."""

import itertools
import math
import re

import pytest

from moerl.config import ConfigError, TaskConfig, load_config
from moerl.tasks import ArithmeticTask, CountdownTask, Prompt, Reward, load_reward_fn, make_task
from moerl.tasks.base import EVAL_PERCENT, split_of, stable_hash
from moerl.tasks.rewards import check_reward_signature

PROBLEM = re.compile(r"(\d+)([-+*])(\d+)=")


def take(task, n, seed=0):
    return list(itertools.islice(task.train_prompts(seed), n))


def test_arithmetic_prompts_answers_and_ranges():
    task = ArithmeticTask(min_digits=2, max_digits=3, operations=("+", "-", "*"))
    prompts = take(task, 500)
    ops = set()
    for p in prompts:
        a, op, b = PROBLEM.fullmatch(p.text).groups()
        a, b = int(a), int(b)
        assert 10 <= a <= 999 and 10 <= b <= 999
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert p.answer == p.solution == str(expected)
        assert p.id == f"arithmetic:{p.text[:-1]}"
        if op == "-":
            assert a >= b  # never negative
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_arithmetic_hand_checked_scores():
    task = ArithmeticTask()
    assert task.reward("12+34=", "46", "46") == Reward(1.0, {"correct": 1.0, "format": 1.0})
    assert task.reward("12+34=", " 46 ", "46").score == 1.0
    assert task.reward("12+34=", "47", "46") == Reward(0.0, {"correct": 0.0, "format": 1.0})
    assert task.reward("12+34=", "46 apples", "46") == Reward(0.0, {"correct": 0.0, "format": 0.0})
    assert task.reward("12+34=", "046", "46").score == 0.0  # exact match
    assert task.reward("12+34=", "", "46").score == 0.0


def test_arithmetic_deterministic_endless_and_seeded():
    a, b = ArithmeticTask(), ArithmeticTask()
    assert take(a, 200) == take(b, 200)
    assert take(a, 200, seed=1) != take(a, 200, seed=0)
    assert a.eval_prompts() == b.eval_prompts()


def test_train_and_eval_disjoint():
    task = ArithmeticTask(num_eval=200)
    evals = task.eval_prompts()
    assert len(evals) == 200 and len({p.id for p in evals}) == 200
    train_ids = {p.id for p in take(task, 20000)}
    assert not train_ids & {p.id for p in evals}
    assert all(split_of(p.text[:-1]) == "eval" for p in evals)


def test_small_space_eval_split():
    task = ArithmeticTask(min_digits=1, max_digits=1, operations=("+",), num_eval=200)
    evals = task.eval_prompts()
    expected = {f"{a}+{b}" for a in range(10) for b in range(10) if split_of(f"{a}+{b}") == "eval"}
    assert {p.text[:-1] for p in evals} == expected
    assert 0 < len(expected) < 100


def test_split_is_a_stable_hash_partition():
    assert stable_hash("12+34") == stable_hash("12+34")  # same in every process (no PYTHONHASHSEED)
    share = sum(split_of(f"{i}") == "eval" for i in range(20000)) / 20000
    assert abs(share - EVAL_PERCENT / 100) < 0.01


def test_template():
    task = make_task(TaskConfig(template="Q: {prompt} A:"))
    p = next(task.train_prompts(0))
    assert p.text.startswith("Q: ") and p.text.endswith(" A:")
    with pytest.raises(ConfigError, match="placeholder"):
        TaskConfig(template="no placeholder")


def test_make_task_builtins_and_config_errors():
    assert isinstance(make_task(TaskConfig()), ArithmeticTask)
    task = make_task(TaskConfig(name="countdown", countdown_min_numbers=3, countdown_max_numbers=3))
    assert isinstance(task, CountdownTask)
    assert all(p.answer.count(",") == 2 for p in take(task, 50))
    with pytest.raises(ConfigError, match="task.name='nope'"):
        TaskConfig(name="nope")
    with pytest.raises(ConfigError, match="task.path is required"):
        TaskConfig(name="jsonl")
    with pytest.raises(ConfigError, match=r"task.min_digits=3 is larger than task.max_digits=2"):
        load_config(None, ["task.min_digits=3", "task.max_digits=2"])
    with pytest.raises(ConfigError, match=r"task.min_digits=3 is larger than task.max_digits=2"):
        load_config(None, ["task.min_digits=3"])  # the built-in max_digits is 2: name both
    with pytest.raises(ConfigError, match=r"task.max_digits=10 is out of range"):
        load_config(None, ["task.max_digits=10"])


USER_REWARDS = """
from moerl.tasks import Reward
calls = []
def length_bonus(prompt, response, answer):
    calls.append(prompt)
    return 0.5 if response.strip() == answer else 0.0
def shaped(prompt, response, answer):
    return Reward(2.0, {"correct": 1.0, "bonus": 1.0})
def broken(prompt, response, answer):
    raise RuntimeError("bug in user reward")
def not_a_number(prompt, response, answer):
    return "high"
def nan(prompt, response, answer):
    return float("nan")
class Scorers:
    @staticmethod
    def exact(prompt, response, answer):
        return response == answer
value = 3
def two_args(prompt, response):
    return 1.0
def with_extras(prompt, response, answer, *, weight=1.0, **info):
    return weight
def star_args(*args):
    return 1.0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_user_reward_by_import_path(user_module):
    task = make_task(TaskConfig(reward_fn=f"{user_module}:length_bonus"))
    p = next(task.train_prompts(0))
    assert task.reward(p.text, p.answer, p.answer) == Reward(0.5, {})
    assert task.reward(p.text, "wrong", p.answer).score == 0.0
    assert task.num_reward_errors == 0
    assert load_reward_fn(f"{user_module}:shaped")("", "", "") == Reward(2.0, {"correct": 1.0, "bonus": 1.0})
    assert load_reward_fn(f"{user_module}:Scorers.exact")("", "7", "7") is True


@pytest.mark.parametrize("fn", ["broken", "not_a_number", "nan"])
def test_raising_or_invalid_reward_scores_zero_and_counts(user_module, fn, caplog):
    task = make_task(TaskConfig(reward_fn=f"{user_module}:{fn}"))
    prompts = take(task, 3)
    rewards = [task.reward(p.text, p.answer, p.answer) for p in prompts]
    assert rewards == [Reward(0.0, {"error": 1.0, "correct": 0.0})] * 3
    assert task.num_reward_errors == 3
    assert "reward function raised" in caplog.text


def test_bad_reward_paths(user_module):
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        load_reward_fn("no_colon")
    with pytest.raises(ImportError, match="cannot import module 'not_a_module_xyz'"):
        load_reward_fn("not_a_module_xyz:fn")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        load_reward_fn(f"{user_module}:missing")
    with pytest.raises(ValueError, match=f"'{user_module}:value' is an int, not a callable"):
        load_reward_fn(f"{user_module}:value")


@pytest.mark.parametrize(
    ("fn", "ok"),
    [
        ("two_args", False),
        ("with_extras", True),
        ("star_args", True),
        ("length_bonus", True),
        ("Scorers.exact", True),
    ],
)
def test_reward_signature_must_take_prompt_response_answer(user_module, fn, ok):
    cfg = TaskConfig(reward_fn=f"{user_module}:{fn}")
    if ok:
        assert make_task(cfg).reward("1+1=", "2", "2").score in (0.0, 0.5, 1.0)
        return
    with pytest.raises(ValueError, match=r"cannot be called as fn\(prompt_text, response_text, answer\)"):
        make_task(cfg)


def test_reward_signature_of_a_builtin_without_one_is_not_checked():
    check_reward_signature(max, "builtins:max")  # inspect.signature(max) raises: nothing to check
    with pytest.raises(ValueError, match="too many positional arguments"):
        check_reward_signature(len, "builtins:len")  # len(obj, /) has one


def test_prompt_and_reward_are_plain_dataclasses():
    p = Prompt(id="x", text="1+1=", answer="2")
    assert p.solution is None
    assert math.isclose(Reward(1.0).score, 1.0) and Reward(1.0).info == {}


def test_arithmetic_counts_its_distinct_training_problems_exactly():
    """1-digit addition: 100 ordered pairs, the eval split's keys left out; subtraction's swapped pairs
    are one problem. A batch of more groups than that can never fill with distinct prompts."""
    from moerl.tasks.arithmetic import ArithmeticTask
    from moerl.tasks.base import split_of

    add = ArithmeticTask(min_digits=1, max_digits=1, operations=("+",))
    assert add.max_train_prompts == sum(split_of(f"{a}+{b}") == "train" for a in range(10) for b in range(10))
    sub = ArithmeticTask(min_digits=1, max_digits=1, operations=("-",))
    assert sub.max_train_prompts == sum(
        split_of(f"{a}-{b}") == "train" for a in range(10) for b in range(a + 1)
    )
