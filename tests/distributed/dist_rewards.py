"""Reward functions of the distributed end-to-end tests (importable by name: ``dist_rewards:...``)."""

from moerl.tasks import Reward


def odd_length(prompt: str, response: str, answer: str) -> float:
    """1 for a response of odd length: varies within a group and with the length, so that the token-mean
    policy-gradient loss is far from 0 even on-policy, and a few steps cannot saturate it."""
    return float(len(response) % 2)


def first_is_digit(prompt: str, response: str, answer: str) -> Reward:
    """1 when the response starts with a digit: a signal even a random policy gets half the time. It is
    also what these tests count as correct (``info["correct"]``), so held-out accuracy measures it too."""
    score = float(response[:1].isdigit())
    return Reward(score, {"correct": score})
