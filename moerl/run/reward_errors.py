"""Stopping a run whose reward function fails: on every sample of the first step, or on more than
``task.max_reward_error_fraction`` of the samples of the last ``task.reward_error_window`` steps.

A failed sample is one whose ``Reward.info["error"]`` is set (``moerl.tasks.base.Task.reward``: the
function raised or returned a non-number). Workers score in their own processes; the driver sees the
flags on each batch's samples, and re-scores one failed sample with its own copy of the task to name the
failure (``Task.explain_failure``).
"""

from __future__ import annotations

from collections import deque

from moerl.config import TaskConfig
from moerl.errors import RewardFunctionError
from moerl.records import Group
from moerl.tasks import Task, Tokenizer


def failed_samples(groups: list[Group]) -> list[tuple[Group, int]]:
    """``(group, sample index)`` of every sample whose reward function failed."""
    return [(g, i) for g in groups for i, s in enumerate(g.samples) if s.reward_info.get("error", 0.0) > 0]


class RewardErrorWatch:
    """Counts reward failures step by step and raises ``RewardFunctionError`` when the run must stop.

    Args:
        cfg: the task section (``reward_fn``, ``max_reward_error_fraction``, ``reward_error_window``).
        task, tokenizer: the driver's task and tokenizer, to re-score one failed sample for the message.
    """

    def __init__(self, cfg: TaskConfig, task: Task, tokenizer: Tokenizer) -> None:
        self.cfg, self.task, self.tokenizer = cfg, task, tokenizer
        self.window: deque[tuple[int, int]] = deque(maxlen=cfg.reward_error_window)
        self.steps_seen = 0

    def observe(self, groups: list[Group]) -> None:
        """Record one batch (before it is trained).

        Raises:
            RewardFunctionError: every sample of the run's first batch failed, or the window is full and
                more than ``max_reward_error_fraction`` of its samples failed.
        """
        failed = failed_samples(groups)
        num_samples = sum(len(g.samples) for g in groups)
        self.window.append((len(failed), num_samples))
        self.steps_seen += 1
        if not failed:
            return
        if self.steps_seen == 1 and len(failed) == num_samples:
            raise RewardFunctionError(self._line(failed, f"all {num_samples} samples of the first step"))
        errors, total = (sum(x) for x in zip(*self.window, strict=True))
        limit = self.cfg.max_reward_error_fraction
        if len(self.window) == self.window.maxlen and limit < 1.0 and errors > limit * total:
            what = (
                f"{errors} of {total} samples of the last {len(self.window)} steps "
                f"(more than task.max_reward_error_fraction={limit})"
            )
            raise RewardFunctionError(self._line(failed, what))

    def _line(self, failed: list[tuple[Group, int]], what: str) -> str:
        group, i = failed[0]
        sample = group.samples[i]
        why = self.task.explain_failure(
            group.task.prompt_text,
            self.tokenizer.decode(list(sample.response_ids)),
            group.task.answer,
            getattr(group.task, "extra", None),  # a RolloutTask's; a stand-in may have none
        )
        name = (
            f"task.reward_fn={self.cfg.reward_fn!r}"
            if self.cfg.reward_fn
            else f"the {self.cfg.name} verifier"
        )
        return f"{name} failed on {what}" + (f"; first: {why}" if why else "")
