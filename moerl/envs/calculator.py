"""Tool-use arithmetic: the policy may call a calculator before it answers.

    prompt   "37*48=?\\n"
    policy   "c 37*48\\n"        a tool call (any expression the safe evaluator ``moerl.envs.calc`` accepts)
    env      "=1776\\n"          the tool's answer (``=error`` for an expression it refuses)
    policy   "a 1776\\n"         the answer: reward 1 if it equals the value, else 0; the episode ends

Any other action ends the episode with reward 0 (``format`` 0). Problems have ``env.min_terms`` ..
``env.max_terms`` operands of ``env.digits`` digits joined by operators of ``env.ops`` (Python
precedence); the number of operands follows a truncated Zipf law (``env.terms_zipf``), and the
demonstrations evaluate one operator per tool call left to right (problems with several operands use
only ``+``/``-``, where left to right is the value), so turns per episode are long-tailed when
``max_terms > min_terms``. A share ``env.demo_tool_frac`` of the demonstrations uses the tool; the
others answer at once, which a small model cannot do for products of two 2-digit numbers: RL learns
to call the tool.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from moerl.envs.base import Environment, StepResult
from moerl.envs.calc import CalcError, evaluate, format_value
from moerl.tasks.base import Prompt, stable_hash

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config_env import EnvConfig
    from moerl.envs.task import EnvTask


def draw_problem(cfg: EnvConfig, rng: random.Random) -> tuple[str, Prompt]:
    """One problem: ``(key, Prompt(text="37*48=?\\n", answer="1776"))``."""
    span = cfg.max_terms - cfg.min_terms
    weights = [1.0 / (j + 1) ** cfg.terms_zipf for j in range(span + 1)]
    num_terms = cfg.min_terms + rng.choices(range(span + 1), weights)[0]
    ops = cfg.ops if num_terms == 2 else "".join(op for op in cfg.ops if op in "+-") or "+"
    lo, hi = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    expr = str(rng.randint(lo, hi))
    for _ in range(num_terms - 1):
        expr += rng.choice(ops) + str(rng.randint(lo, hi))
    answer = format_value(evaluate(expr))
    return expr, Prompt(id=f"calc-{stable_hash(expr):016x}", text=f"{expr}=?\n", answer=answer)


def _terms(expr: str) -> list[str]:
    """Split ``"12+7-3"`` into ``["12", "+7", "-3"]`` (operands with their operator)."""
    out, cur = [], ""
    for ch in expr:
        if ch in "+-*" and cur:
            out.append(cur)
            cur = ""
        cur += ch
    return out + [cur]


class CalculatorEnv(Environment):
    """One episode of tool-use arithmetic (see the module docstring)."""

    def reset(self, task: Prompt) -> str:
        self.answer = task.answer
        return task.text

    def step(self, action: str) -> StepResult:
        kind, _, arg = action.strip().partition(" ")
        if kind == "c":
            if self.cfg.step_latency_s:
                time.sleep(self.cfg.step_latency_s)
            try:
                value = format_value(evaluate(arg))
            except CalcError:
                value = "error"
            return StepResult(f"={value}\n", 0.0, False, {"tool_calls": 1.0})
        if kind == "a":
            correct = float(arg.strip() == self.answer)
            return StepResult("", correct, True, {"correct": correct, "format": 1.0})
        return StepResult("", 0.0, True, {"correct": 0.0, "format": 0.0})

    @classmethod
    def make_task(cls, cfg: EnvConfig, *, num_eval: int, seed: int) -> EnvTask:
        from moerl.envs.task import EnvTask  # the engine and torch: not in an environment worker's process

        return EnvTask(
            cls, cfg, lambda rng: draw_problem(cfg, rng), name="calculator", num_eval=num_eval, seed=seed
        )

    @classmethod
    def demonstration(cls, cfg: EnvConfig, task: Prompt) -> list[str]:
        """Tool calls one operator at a time, then the answer; or the answer at once for a
        ``1 - demo_tool_frac`` share of tasks (chosen by a hash of the task id)."""
        if stable_hash(f"demo:{task.id}") % 1000 >= cfg.demo_tool_frac * 1000:
            return [f"a {task.answer}"]
        expr = task.text.removesuffix("=?\n")
        terms = _terms(expr)
        if len(terms) == 2:
            return [f"c {expr}", f"a {task.answer}"]
        actions, acc = [], terms[0]
        for term in terms[1:]:
            actions.append(f"c {acc}{term}")
            acc = format_value(evaluate(acc + term))
        return actions + [f"a {task.answer}"]
