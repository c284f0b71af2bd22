"""Reward functions for the end-to-end tests (imported by ``task.reward_fn``)."""


def first_is_digit(prompt: str, response: str, answer: str) -> float:
    """1 when the response starts with a digit: a signal even a random policy gets half the time."""
    return float(response[:1].isdigit())


def raising_reward(prompt: str, response: str, answer: str) -> float:
    """Always raises, as a broken user reward function would."""
    raise RuntimeError("reward service down")
