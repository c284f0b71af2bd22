"""Contract of a task (``moerl.tasks.TASKS``, docs/extending.md "Task"): every registered task builder,
and any new one, must give a task whose training prompts are reproducible for a seed, whose held-out
prompts are held out (never drawn for training), and whose reward never raises and returns a ``Reward``
of floats, one per sample in ``reward_many`` as in ``reward``.

``TASK_CONFIGS`` holds the overrides that build each registered name here (a dataset task reads the
small JSONL written by ``_dataset``); a new task adds its line, ``test_every_registered_task_is_checked``
fails until it does."""

from __future__ import annotations

import itertools
import json

import pytest

from moerl.config import load_config
from moerl.tasks import TASKS, Reward, make_task

NUM_DRAWN = 64
"""Training prompts drawn per check (the held-out check compares their texts with the held-out set)."""
GARBAGE = ["", "\x00\x01 \n####", "9" * 200, "{not json", "1/0"]
"""Responses a reward must score without raising."""


def _dataset(tmp_path) -> list[str]:
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(40)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"task.path={path}", "task.layout=generic", "task.num_eval=8"]


TASK_CONFIGS = {
    "arithmetic": lambda tmp_path: [],
    "countdown": lambda tmp_path: [],
    "dataset": _dataset,
    "jsonl": _dataset,
    "env": lambda tmp_path: ["env.name=calculator"],
}
"""Registered task name -> ``tmp_path -> overrides`` that build it on this machine."""


def check_task_contract(task, seed: int = 3) -> None:
    """Assert the task contract (module docstring) of ``task``; raises AssertionError naming the rule."""
    first = list(itertools.islice(task.train_prompts(seed), NUM_DRAWN))
    again = list(itertools.islice(task.train_prompts(seed), NUM_DRAWN))
    assert first and [p.text for p in first] == [p.text for p in again], (
        "train_prompts(seed) not reproducible"
    )
    held_out = task.eval_prompts()
    assert held_out, "no held-out prompts"
    assert not {p.text for p in held_out} & {p.text for p in first}, "a held-out prompt is drawn for training"

    prompt = first[0]
    rewards = [task.reward(prompt.text, r, prompt.answer) for r in GARBAGE]
    for reward in rewards:
        assert isinstance(reward, Reward) and isinstance(reward.score, float), (
            f"not a Reward of floats: {reward}"
        )
        assert all(isinstance(v, float) for v in reward.info.values()), f"info must be floats: {reward.info}"
    n = len(GARBAGE)
    many = task.reward_many([prompt.text] * n, GARBAGE, [prompt.answer] * n, [None] * n)
    assert [r.score for r in many] == [r.score for r in rewards], "reward_many differs from reward"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_registered_task_meets_the_contract(name, tmp_path):
    cfg = load_config(None, [f"task.name={name}", *TASK_CONFIGS[name](tmp_path)])
    check_task_contract(make_task(cfg.task, cfg.env))


def test_every_registered_task_is_checked():
    assert set(TASKS) == set(TASK_CONFIGS)


class LeakyTask:
    """A task whose held-out prompt is also a training prompt: the contract must refuse it."""

    def __init__(self, inner):
        self.inner = inner

    def train_prompts(self, seed):
        return itertools.chain(self.inner.eval_prompts()[:1], self.inner.train_prompts(seed))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_task_leaking_its_held_out_prompts_is_refused():
    cfg = load_config(None, ["task.name=arithmetic"])
    with pytest.raises(AssertionError, match="held-out prompt is drawn"):
        check_task_contract(LeakyTask(make_task(cfg.task, cfg.env)))
