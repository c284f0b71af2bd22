"""The ``arithmetic`` task: multi-digit addition, subtraction and multiplication.

A problem ``a op b`` is shown as ``"a op b="`` (through the template) and its answer is the exact
integer result; a response is correct only when it is exactly that integer (exact match after
stripping whitespace). Operand sizes are drawn per operand: a digit count uniform in
``[min_digits, max_digits]``, then a value uniform among the numbers with that many digits (one
digit includes 0). For subtraction the larger operand comes first, so answers are never negative.
"""

from __future__ import annotations

import random
import re

from moerl.tasks.base import GeneratedTask, Prompt, Reward, ScoreFn, split_of

_INTEGER = re.compile(r"-?\d+")

_EXACT_COUNT_LIMIT = 10**4
"""Operand pairs up to which ``max_train_prompts`` counts the problems exactly (2-digit operands: 10^4)."""

OPERATIONS = ("+", "-", "*")
"""The operators an arithmetic problem may use (``task.operations``)."""


class ArithmeticTask(GeneratedTask):
    """Generated arithmetic problems with disjoint (hash-partitioned) train and eval splits.

    Args:
        min_digits, max_digits: operand size range in decimal digits, 1 <= min <= max.
        operations: operators to draw from, any of ``"+"``, ``"-"``, ``"*"``.
        num_eval: held-out prompts returned by ``eval_prompts`` (fewer if the eval split is smaller).
        seed: seed of the eval prompt draw.
        template: prompt template with a ``{prompt}`` placeholder for ``"a op b"``.
        score_fn: a user reward function replacing the exact-match verifier.
    """

    name = "arithmetic"

    def __init__(
        self,
        *,
        min_digits: int = 1,
        max_digits: int = 2,
        operations: tuple[str, ...] = ("+", "-"),
        num_eval: int = 200,
        seed: int = 0,
        template: str = "{prompt}=",
        score_fn: ScoreFn | None = None,
    ) -> None:
        super().__init__(score_fn)
        if not operations or any(op not in OPERATIONS for op in operations):
            raise ValueError(f"operations={operations!r}: choose among {', '.join(map(repr, OPERATIONS))}")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.operations = tuple(operations)
        self.num_eval, self.seed, self.template = num_eval, seed, template

    @property
    def max_train_prompts(self) -> int:
        """The distinct training problems: counted exactly (subtraction's swapped pairs merged, eval-split
        keys left out) when the space has at most ``_EXACT_COUNT_LIMIT`` operand pairs per operation, else an
        upper bound (every ordered pair for every operation)."""
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        pairs = (10**self.max_digits - lo) ** 2
        if pairs > _EXACT_COUNT_LIMIT:
            return pairs * len(self.operations)
        keys = set()
        for a in range(lo, 10**self.max_digits):
            for b in range(lo, 10**self.max_digits):
                for op in self.operations:
                    x, y = (b, a) if op == "-" and b > a else (a, b)
                    keys.add(f"{x}{op}{y}")
        return sum(split_of(k) == "train" for k in keys)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(lo, 10**digits - 1)

    def _draw(self, rng: random.Random) -> tuple[str, Prompt]:
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.operations)
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        key = f"{a}{op}{b}"
        answer = str(result)
        return key, Prompt(
            id=f"arithmetic:{key}", text=self.template.format(prompt=key), answer=answer, solution=answer
        )

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """1.0 when the stripped response is exactly ``answer``; ``format`` = it is a plain integer."""
        response = response_text.strip()
        correct = float(response == answer.strip())
        return Reward(correct, {"correct": correct, "format": float(bool(_INTEGER.fullmatch(response)))})
