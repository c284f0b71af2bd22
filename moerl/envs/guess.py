"""A multi-turn guessing game with feedback each turn.

    prompt   "guess 23..51\\n"    a secret integer in the range
    policy   "g 37\\n"
    env      ">38..51\\n"          higher: the secret is in 38..51 (or "<23..36\\n": lower)
    policy   "g 44\\n"  ...        until the guess is right: reward 1, ``correct`` 1, the episode ends

The feedback restates the range left, so a policy that guesses the midpoint of the last range needs
at most ceil(log2(width + 1)) turns; ``env.max_turns`` caps the episode (reward 0 when reached).
A malformed action ends the episode with reward 0 (``format`` 0). Ranges are ``env.min_width`` ..
``env.max_width`` numbers inside 0..``env.max_value``; the demonstrations guess midpoints (or, for a
share ``env.demo_scan_frac``, scan up from the low end: easy to imitate, rarely in time).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING

from moerl.envs.base import Environment, StepResult
from moerl.tasks.base import Prompt, stable_hash

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config_env import EnvConfig
    from moerl.envs.task import EnvTask

_RANGE = re.compile(r"guess (\d+)\.\.(\d+)")


def draw_game(cfg: EnvConfig, rng: random.Random) -> tuple[str, Prompt]:
    """One game: ``(key "lo..hi:secret", Prompt(text="guess lo..hi\\n", answer=str(secret)))``."""
    width = rng.randint(cfg.min_width, cfg.max_width)
    lo = rng.randint(0, cfg.max_value - width + 1)
    hi = lo + width - 1
    secret = rng.randint(lo, hi)
    key = f"{lo}..{hi}:{secret}"
    return key, Prompt(id=f"guess-{key}", text=f"guess {lo}..{hi}\n", answer=str(secret))


class GuessEnv(Environment):
    """One game (see the module docstring)."""

    def reset(self, task: Prompt) -> str:
        m = _RANGE.match(task.text)
        if m is None:
            raise ValueError(f"guess: prompt {task.text!r} is not 'guess LO..HI'")
        self.lo, self.hi, self.secret = int(m[1]), int(m[2]), int(task.answer)
        return task.text

    def step(self, action: str) -> StepResult:
        kind, _, arg = action.strip().partition(" ")
        if kind != "g" or not arg.isdigit():
            return StepResult("", 0.0, True, {"correct": 0.0, "format": 0.0})
        guess = int(arg)
        if guess == self.secret:
            return StepResult("", 1.0, True, {"correct": 1.0, "format": 1.0})
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            return StepResult(f">{self.lo}..{self.hi}\n", 0.0, False, {"correct": 0.0, "format": 1.0})
        self.hi = min(self.hi, guess - 1)
        return StepResult(f"<{self.lo}..{self.hi}\n", 0.0, False, {"correct": 0.0, "format": 1.0})

    @classmethod
    def make_task(cls, cfg: EnvConfig, *, num_eval: int, seed: int) -> EnvTask:
        from moerl.envs.task import EnvTask  # the engine and torch: not in an environment worker's process

        return EnvTask(cls, cfg, lambda rng: draw_game(cfg, rng), name="guess", num_eval=num_eval, seed=seed)

    @classmethod
    def demonstration(cls, cfg: EnvConfig, task: Prompt) -> list[str]:
        """Midpoint guesses of the range left until the secret is hit; for a share ``env.demo_scan_frac``
        of tasks (by a hash of the task id) guesses from the low end up instead, for at most
        ``env.max_turns`` turns."""
        m = _RANGE.match(task.text)
        lo, hi, secret = int(m[1]), int(m[2]), int(task.answer)
        if stable_hash(f"demo:{task.id}") % 1000 < cfg.demo_scan_frac * 1000:
            return [f"g {g}" for g in range(lo, min(secret, lo + cfg.max_turns - 1) + 1)]
        actions = []
        while True:
            mid = (lo + hi) // 2
            actions.append(f"g {mid}")
            if mid == secret:
                return actions
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
