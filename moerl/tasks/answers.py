"""Numeric answer extraction and comparison for math-word-problem datasets (GSM8K and the like).

The final answer of a response is, in order of preference: the content of the last ``\\boxed{...}``,
the number after the last ``####``, the number after the last "answer is", else the last number in
the text. Numbers may carry a sign (``-``, ``+``, Unicode minus), thousands commas (``1,234``), a
decimal part, a leading currency sign, and trailing units or a period (``18 dollars.``). Two answers
match when their values are equal as exact fractions (``3.50 == 3.5``, ``1,000 == 1000``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(
    r"(?<![\w.])"  # not glued to a word or to a preceding decimal point
    r"([-+\u2212]?)\$?"  # sign, optional currency sign
    r"(\d{1,3}(?:,\d{3})+|\d+)"  # integer part, optionally with thousands commas
    r"(\.\d+)?"  # decimal part
    r"(?:\s*/\s*(\d+))?"  # optional simple fraction denominator: 3/4
)
_BOXED = "\\boxed{"
_HASHES = re.compile(r"####\s*(.*)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.*)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The value of the first number in ``text``, or ``None`` if it holds no number.

    Examples: ``"1,234"`` -> 1234, ``"-3.50 kg."`` -> -7/2, ``"$18"`` -> 18, ``"3/4"`` -> 3/4.
    """
    m = _NUMBER.search(text)
    return None if m is None else _value(m)


def _value(m: re.Match[str]) -> Fraction | None:
    sign, integer, decimal, denominator = m.groups()
    value = Fraction(integer.replace(",", "") + (decimal or ""))
    if denominator is not None:
        if int(denominator) == 0:
            return None
        value /= int(denominator)
    return -value if sign in ("-", "\u2212") else value


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced; ``None`` if absent."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> Fraction | None:
    """The final numeric answer of a response (see the module docstring for the rules).

    Returns:
        The exact value, or ``None`` when no number is found.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return parse_number(boxed.replace("\\frac{", "").replace("}{", "/"))
    for pattern in (_HASHES, _ANSWER_IS):
        tails = pattern.findall(text)
        if tails:
            value = parse_number(tails[-1])
            if value is not None:
                return value
    matches = list(_NUMBER.finditer(text))
    return _value(matches[-1]) if matches else None


def format_number(value: Fraction) -> str:
    """A canonical string: ``"46"``, ``"-3.5"``, or ``"1/3"`` when not a finite decimal."""
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    if Fraction(repr(as_float)) == value:
        return repr(as_float)
    return f"{value.numerator}/{value.denominator}"


def answers_match(response_text: str, gold: str) -> bool:
    """True when the response's final number equals the gold answer's final number exactly.

    A gold answer always matches itself. A gold without any number matches nothing.
    """
    gold_value = extract_answer(gold)
    return gold_value is not None and extract_answer(response_text) == gold_value
