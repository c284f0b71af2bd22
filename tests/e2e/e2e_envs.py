"""Environments of the end-to-end episode tests (imported by path: ``env.name=e2e_envs:...``)."""

import threading
import time

from moerl.envs.base import StepResult
from moerl.envs.calculator import CalculatorEnv
from moerl.tasks.base import stable_hash


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
    """``SlowEchoEnv`` without the sleep whose first step raises the first time one in three tasks is
    played in this process (by task id): those groups fail once, are requeued and then succeed."""

    failed_once: set = set()
    lock = threading.Lock()

    def reset(self, task):
        self.task_id = task.id
        return super().reset(task)

    def step(self, action):
        with FlakyEnv.lock:
            should_fail = (
                self.turns == 0
                and stable_hash(self.task_id) % 3 == 0
                and self.task_id not in FlakyEnv.failed_once
            )
            FlakyEnv.failed_once.add(self.task_id)
        if should_fail:
            raise RuntimeError("flaky environment")
        self.turns += 1
        self.digits += any(ch.isdigit() for ch in action)
        if self.turns >= 2:
            score = float(self.digits > 0)
            return StepResult("", score, True, {"correct": score})
        return StepResult("ok\n", 0.0, False, {})
