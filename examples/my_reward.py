"""The examples' reward: full credit for the right sum, a little for the answer format.

moerl calls ``score(prompt_text, response_text, answer)`` for every sample (``task.reward_fn:
my_reward:score``); it finds this module beside the config file, no PYTHONPATH needed. ``answer`` is the
row's gold answer (here the number after ``####`` in the assistant message).
"""

from moerl.tasks import Reward


def score(prompt: str, response: str, answer: str) -> Reward:
    """1.0 when the number after ``####`` equals ``answer``, plus 0.1 for writing ``####`` at all.

    Returns ``Reward(score, {"correct": 0 or 1})``: ``correct`` is what held-out accuracy counts, so the
    format bonus never makes a wrong answer count as right.
    """
    given = response.split("####")[-1].strip() if "####" in response else ""
    correct = float(given == str(answer).strip())
    return Reward(correct + 0.1 * ("####" in response), {"correct": correct})
