"""The ``countdown`` task: combine the given numbers with + - * / to reach a target.

Given 3-4 numbers and a target, the response is an equation such as ``(25-7)*3+50`` (optionally
followed by ``=75``) that uses each given number at most once. The checker never executes the
response: it parses it with ``ast.parse(mode="eval")`` (parsing builds a syntax tree only) and walks
the tree itself, accepting integer literals, the binary operators ``+ - * /`` and parentheses, and
nothing else (no names, calls, attributes, unary signs or powers). Values are exact ``Fraction``s,
so ``6/4*2 == 3`` holds and division by zero is detected, never raised.

The gold answer string is ``"3,7,25,50=75"``: the given numbers and the target.
"""

from __future__ import annotations

import ast
import operator
import random
from collections import Counter
from fractions import Fraction

from moerl.tasks.base import GeneratedTask, Prompt, Reward, ScoreFn

MAX_EQUATION_CHARS = 120
"""Longer responses are rejected before parsing (bounds the parser's work and recursion)."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class NotArithmetic(ValueError):
    """The equation contains something other than integers, + - * / and parentheses."""


class DivisionByZero(ValueError):
    """The equation divides by zero."""


def evaluate_equation(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an arithmetic expression without executing it.

    Args:
        text: e.g. ``"(25-7)*3+50"``; whitespace is allowed.

    Returns:
        The exact value and the integer literals used, in order of appearance.

    Raises:
        NotArithmetic: syntax error, too long, or any construct other than non-negative integer
            literals, binary ``+ - * /`` and parentheses.
        DivisionByZero: a divisor evaluates to 0.
    """
    if len(text) > MAX_EQUATION_CHARS:
        raise NotArithmetic(f"longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise NotArithmetic(f"does not parse: {type(e).__name__}") from None
    numbers: list[int] = []
    return _walk(tree.body, numbers), numbers


def _walk(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, numbers), _walk(node.right, numbers)
        if isinstance(node.op, ast.Div) and right == 0:
            raise DivisionByZero("division by zero")
        return _OPS[type(node.op)](left, right)
    what = type(node.op).__name__ if isinstance(node, ast.BinOp) else type(node).__name__
    raise NotArithmetic(f"{what} is not allowed")


def parse_answer(answer: str) -> tuple[list[int], int]:
    """Split the gold answer ``"3,7,25,50=75"`` into the given numbers and the target.

    Raises:
        ValueError: the string does not have that shape.
    """
    numbers, _, target = answer.partition("=")
    return [int(n) for n in numbers.split(",")], int(target)


def check_equation(response_text: str, answer: str) -> Reward:
    """Score a countdown response against the gold ``"numbers=target"``; never executes the response.

    Returns:
        ``Reward(1.0)`` when the equation uses only the given numbers (each at most once) and equals
        the target. ``info``: ``correct``, ``format`` (valid arithmetic over the given numbers), and
        one of ``not_arithmetic``, ``div_by_zero``, ``bad_number`` (reused or not given) when it applies.
    """
    numbers, target = parse_answer(answer)
    equation = response_text.strip().split("\n", 1)[0]
    claimed = None
    if "=" in equation:
        equation, _, rhs = equation.partition("=")
        claimed = rhs.strip()
    try:
        value, used = evaluate_equation(equation)
    except DivisionByZero:
        return Reward(0.0, {"correct": 0.0, "format": 0.0, "div_by_zero": 1.0})
    except NotArithmetic:
        return Reward(0.0, {"correct": 0.0, "format": 0.0, "not_arithmetic": 1.0})
    if Counter(used) - Counter(numbers):
        return Reward(0.0, {"correct": 0.0, "format": 0.0, "bad_number": 1.0})
    correct = float(value == target and claimed in (None, "", str(target)))
    return Reward(correct, {"correct": correct, "format": 1.0})


def _combine(numbers: list[int], ops: list[str]) -> tuple[Fraction, str]:
    """Fold ``numbers`` left to right with ``ops``; returns the value and a minimally bracketed string."""
    value, text, last = Fraction(numbers[0]), str(numbers[0]), None
    for n, op in zip(numbers[1:], ops, strict=True):
        if op in "*/" and last in ("+", "-"):
            text = f"({text})"
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        text, last = f"{text}{op}{n}", op
    return value, text


class CountdownTask(GeneratedTask):
    """Generated countdown problems, always solvable, with disjoint (hash-partitioned) splits.

    Args:
        min_numbers, max_numbers: how many numbers are given (3-4 by default).
        max_value: the given numbers are uniform in ``[1, max_value]``.
        num_eval, seed: held-out size and the seed of its draw.
        template: prompt template with a ``{prompt}`` placeholder for ``"3 7 25 50 -> 75"``.
        score_fn: a user reward function replacing ``check_equation``.
    """

    name = "countdown"

    def __init__(
        self,
        *,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_value: int = 50,
        num_eval: int = 200,
        seed: int = 0,
        template: str = "{prompt}:",
        score_fn: ScoreFn | None = None,
    ) -> None:
        super().__init__(score_fn)
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        self.min_numbers, self.max_numbers, self.max_value = min_numbers, max_numbers, max_value
        self.num_eval, self.seed, self.template = num_eval, seed, template

    def _draw(self, rng: random.Random) -> tuple[str, Prompt]:
        """A problem whose target (a positive integer) comes from one random equation over all numbers."""
        while True:
            count = rng.randint(self.min_numbers, self.max_numbers)
            numbers = [rng.randint(1, self.max_value) for _ in range(count)]
            ops = [rng.choice("+-*/") for _ in range(count - 1)]
            value, solution = _combine(numbers, ops)
            if value.denominator == 1 and 0 < value <= 1000:
                break
        target = int(value)
        shown = sorted(numbers)
        key = f"{','.join(map(str, shown))}={target}"
        raw = f"{' '.join(map(str, shown))} -> {target}"
        return key, Prompt(
            id=f"countdown:{key}", text=self.template.format(prompt=raw), answer=key, solution=solution
        )

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """See ``check_equation``."""
        return check_equation(response_text, answer)
