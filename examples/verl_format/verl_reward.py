"""The example's reward: reads verl's ``reward_model.ground_truth`` and ``extra_info`` from ``extra``.

moerl passes ``extra`` (every column of the row it did not consume, nested as in the parquet file) to a
reward function that names that parameter. A correct final number scores 1.0; a wrong number scores the
row's ``extra_info.partial_credit``; no number scores 0. ``correct`` makes held-out exact match and
pass@k count only right answers, not partial credit.
"""

from __future__ import annotations

import re

from moerl.tasks import Reward


def score(prompt: str, response: str, answer: str, extra: dict) -> Reward:
    """Reward of ``response``: 1.0 right, ``extra_info.partial_credit`` for a wrong number, else 0."""
    numbers = re.findall(r"-?\d+", response)
    if not numbers:
        return Reward(0.0, {"correct": 0.0})
    correct = float(numbers[-1] == str(extra["reward_model"]["ground_truth"]))
    partial = float(extra["extra_info"]["partial_credit"])
    return Reward(correct or partial, {"correct": correct})
