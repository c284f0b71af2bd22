"""Reward functions for the end-to-end tests (imported by ``task.reward_fn``)."""

from moerl.tasks import Reward


def first_is_digit(prompt: str, response: str, answer: str) -> Reward:
    """1 when the response starts with a digit: a signal even a random policy gets half the time. It is
    also what these tests count as correct (``info["correct"]``), so held-out accuracy measures it too."""
    score = float(response[:1].isdigit())
    return Reward(score, {"correct": score})


def raising_reward(prompt: str, response: str, answer: str) -> float:
    """Always raises, as a broken user reward function would."""
    raise RuntimeError("reward service down")
