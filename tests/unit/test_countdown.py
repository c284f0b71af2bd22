"""Countdown checker: every kind of response is scored, nothing is executed, nothing raises."""

import itertools
from fractions import Fraction

import pytest

from moerl.tasks.countdown import (
    CountdownTask,
    DivisionByZero,
    NotArithmetic,
    check_equation,
    evaluate_equation,
    parse_answer,
)

GOLD = "3,7,25,50=75"  # numbers 3 7 25 50, target 75


@pytest.mark.parametrize(
    "response", ["50+25", " 50 + 25 ", "25+50=75", "50+25\nmore text", "3*25", "(50-25)*3", "(7-3)*25-50+25"]
)
def test_valid_equations_score_one(response):
    if response == "(7-3)*25-50+25":  # 25 reused: valid arithmetic but not a valid answer
        assert check_equation(response, GOLD).info["bad_number"] == 1.0
        return
    reward = check_equation(response, GOLD)
    assert reward.score == 1.0 and reward.info == {"correct": 1.0, "format": 1.0}


def test_valid_equation_values_hand_computed():
    assert evaluate_equation("(25-7)*3+50") == (Fraction(104), [25, 7, 3, 50])
    assert evaluate_equation("50/(7-3)") == (Fraction(25, 2), [50, 7, 3])
    # exact rational arithmetic: 6/8*4 = 3 (a float evaluation would also work here, 6/7*7 would not)
    assert check_equation("6/8*4", "4,6,8=3").score == 1.0
    assert check_equation("6/7*7", "6,7,7=6").score == 1.0


@pytest.mark.parametrize(
    ("response", "flag"),
    [
        ("50+7", None),  # valid arithmetic, wrong result 57
        ("50+25=76", None),  # right expression, wrong claimed result
        ("50+50-25", "bad_number"),  # 50 reused
        ("25+25+25", "bad_number"),  # 25 reused
        ("51+24", "bad_number"),  # numbers not given
        ("75", "bad_number"),
        ("50/(7-7)", "div_by_zero"),
        ("3/(25-25)", "div_by_zero"),
        ("x+50", "not_arithmetic"),  # a name
        ("__import__('os').system('touch /tmp/pwned')", "not_arithmetic"),  # call, attribute
        ("(50).real+25", "not_arithmetic"),  # attribute
        ("9**9**9**9", "not_arithmetic"),  # exponent tower: refused before any evaluation
        ("3**50", "not_arithmetic"),
        ("-3+78", "not_arithmetic"),  # unary minus
        ("50+25.0", "not_arithmetic"),  # float literal
        ("[50, 25]", "not_arithmetic"),
        ("lambda: 75", "not_arithmetic"),
        ("50 +", "not_arithmetic"),  # syntax error
        ("", "not_arithmetic"),
        ("(" * 300 + "3" + ")" * 300, "not_arithmetic"),  # too long / too deep
        ("7" * 5000, "not_arithmetic"),  # huge literal
    ],
)
def test_wrong_or_unsafe_scores_zero_with_reason(response, flag):
    reward = check_equation(response, GOLD)
    assert reward.score == 0.0
    assert reward.info["correct"] == 0.0
    if flag is None:
        assert reward.info["format"] == 1.0
    else:
        assert reward.info[flag] == 1.0
        assert reward.info["format"] == 0.0


def test_nothing_is_executed(tmp_path):
    target = tmp_path / "pwned"
    check_equation(f"__import__('pathlib').Path('{target}').touch()", GOLD)
    check_equation(f"open('{target}', 'w')", GOLD)
    assert not target.exists()


def test_evaluate_equation_raises_typed_errors():
    with pytest.raises(DivisionByZero):
        evaluate_equation("1/0")
    with pytest.raises(NotArithmetic, match="Call"):
        evaluate_equation("print(1)")
    with pytest.raises(NotArithmetic, match="Pow"):
        evaluate_equation("2**3")


def test_parse_answer():
    assert parse_answer(GOLD) == ([3, 7, 25, 50], 75)


def test_generated_problems_solvable_deterministic_and_disjoint():
    task = CountdownTask(num_eval=50, seed=0)
    train = list(itertools.islice(task.train_prompts(3), 300))
    assert train == list(itertools.islice(CountdownTask(num_eval=50).train_prompts(3), 300))
    for p in train[:100]:
        numbers, target = parse_answer(p.answer)
        assert 3 <= len(numbers) <= 4 and target > 0
        assert task.reward(p.text, p.solution, p.answer).score == 1.0
        assert p.text == f"{' '.join(map(str, numbers))} -> {target}:"
    evals = task.eval_prompts()
    assert len(evals) == 50 and len({p.id for p in evals}) == 50
    assert not {p.id for p in evals} & {p.id for p in train}


def test_task_reward_uses_checker():
    task = CountdownTask()
    assert task.reward("3 7 25 50 -> 75:", "25*3", GOLD).score == 1.0
    assert task.reward("3 7 25 50 -> 75:", "__import__('os')", GOLD).score == 0.0
    assert task.num_reward_errors == 0
