from fractions import Fraction

import pytest

from moerl.envs.calc import MAX_ABS, CalcError, evaluate, format_value


@pytest.mark.parametrize(
    "expr, value",
    [
        ("37*48", 1776),
        ("12+7-3", 16),
        ("2*(3+4)", 14),
        ("-5+2", -3),
        ("7/2", Fraction(7, 2)),
        ("7//2", 3),
        ("2**10", 1024),
        ("17%5", 2),
        (" 3 * 3 ", 9),
    ],
)
def test_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os')", "Call"),
        ("x+1", "Name"),
        ("1.5*2", "Constant"),
        ("(1).real", "Attribute"),
        ("1/0", "division by zero"),
        ("2**100", "exponent"),
        ("9" * 70, "longer"),
        ("1+", "syntax"),
        ("[1]", "List"),
        ("10**15*10", "range"),
        ("True+1", "Constant"),
    ],
)
def test_refusals_name_the_reason(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


def test_bound_and_format():
    assert evaluate(str(MAX_ABS)) == MAX_ABS
    assert format_value(Fraction(6, 3)) == "2" and format_value(Fraction(-7, 2)) == "-7/2"
