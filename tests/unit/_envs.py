"""Test environments for the moerl.envs tests: scripted, sleeping, raising and hanging ones."""

import os
import threading
import time

from moerl.envs import Environment, StepResult


class EchoEnv(Environment):
    """Observation "ok\\n" after each action; done after ``answer`` turns (default 3) with reward 1."""

    def reset(self, task):
        self.turns, self.limit = 0, int(task.answer or 3)
        return task.text

    def step(self, action):
        self.turns += 1
        if self.turns >= self.limit:
            return StepResult("", 1.0, True, {"correct": 1.0})
        return StepResult("ok\n", 0.0, False, {})


class SleepEnv(EchoEnv):
    """``EchoEnv`` whose steps on prompts starting "slow" sleep until ``SleepEnv.gate`` is set (at most
    ``SleepEnv.max_sleep_s``); with the gate set beforehand they sleep ``SleepEnv.delay_s``."""

    gate = threading.Event()
    max_sleep_s = 30.0
    delay_s = 0.3

    def reset(self, task):
        self.is_slow = task.text.startswith("slow")
        return super().reset(task)

    def step(self, action):
        if self.is_slow:
            if not SleepEnv.gate.wait(SleepEnv.max_sleep_s):
                raise TimeoutError("SleepEnv.gate never set")
            time.sleep(SleepEnv.delay_s)
        return super().step(action)


class FaultEnv(EchoEnv):
    """Raises on "raise" prompts, hangs (sleeps 30 s) on "hang" prompts, else ``EchoEnv``."""

    def reset(self, task):
        self.mode = task.text.split()[0]
        return super().reset(task)

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("environment bug")
        if self.mode == "hang":
            time.sleep(30)
        return super().step(action)


class PidEnv(EchoEnv):
    """``EchoEnv`` whose steps take 0.2 s (so a kill lands mid-episode)."""

    def step(self, action):
        time.sleep(0.2)
        return super().step(action)


def pid() -> int:
    return os.getpid()
