"""Environments of the end-to-end episode tests (imported by path: ``env.name=e2e_envs:...``)."""

import random
import time

from moerl.envs.base import StepResult
from moerl.envs.calculator import CalculatorEnv


class SlowEchoEnv(CalculatorEnv):
    """The calculator's prompts; every step takes 0.2 s and answers "ok\\n"; the second step ends the
    episode with reward 1 when the policy's two actions hold a digit."""

    def reset(self, task):
        self.turns, self.digits = 0, 0
        return super().reset(task)

    def step(self, action):
        time.sleep(0.2)
        self.turns += 1
        self.digits += any(ch.isdigit() for ch in action)
        if self.turns >= 2:
            score = float(self.digits > 0)
            return StepResult("", score, True, {"correct": score})
        return StepResult("ok\n", 0.0, False, {})


class FlakyEnv(SlowEchoEnv):
    """``SlowEchoEnv`` (no sleep) whose first step raises in one episode out of four."""

    def step(self, action):
        if self.turns == 0 and random.random() < 0.25:
            raise RuntimeError("flaky environment")
        self.turns += 1
        self.digits += any(ch.isdigit() for ch in action)
        if self.turns >= 2:
            score = float(self.digits > 0)
            return StepResult("", score, True, {"correct": score})
        return StepResult("ok\n", 0.0, False, {})
