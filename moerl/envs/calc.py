"""A safe arithmetic evaluator for the calculator tool: Python's expression grammar, integers and
fractions only, every node checked, never ``eval``.

Allowed: integer literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses. ``/`` is exact
(``fractions.Fraction``). Bounds keep a hostile expression cheap: at most ``MAX_CHARS`` characters,
exponents at most ``MAX_EXPONENT``, and every intermediate value at most ``MAX_ABS`` in magnitude.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_CHARS = 64
"""Longest expression accepted."""
MAX_EXPONENT = 16
"""Largest exponent of ``**``."""
MAX_ABS = 10**15
"""Largest magnitude of any intermediate value."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """The expression is not allowed or cannot be evaluated (the message says why)."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression.

    Raises:
        CalcError: too long, a syntax error, a name/call/float/other node, division by zero, an
            exponent over ``MAX_EXPONENT`` or a value over ``MAX_ABS``.
    """
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"syntax error: {e.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise CalcError(f"exponent {right} not an integer of at most {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
    raise CalcError(f"{type(node).__name__} is not allowed")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise CalcError(f"value out of range (|x| > {MAX_ABS})")
    return Fraction(value)


def format_value(value: Fraction) -> str:
    """``"12"`` for integers, ``"7/2"`` otherwise."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
