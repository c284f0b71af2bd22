"""Contract of a multi-turn environment (``moerl.envs.base.BUILTIN_ENVS``, or any ``env.name`` import
path; docs/extending.md "Environment"): every registered environment, and any new one, must

- make its own task (``make_task``): the number of held-out prompts asked, none of them drawn for training;
- start an episode with the prompt as its first observation (``reset`` returns text);
- declare ``demonstration(cfg, task)`` as ``Environment`` does, and on its reference policy's actions (``demonstration``, what the SFT warm start imitates) end the
  episode within ``env.max_turns`` turns, solved (``info["correct"] == 1``), each ``step`` a
  ``StepResult`` of (str, float, bool, dict of floats);
- turn a malformed action into a finished or continuing episode, never an exception;
- end turns with ``turn_stop``, one non-empty string.
"""

from __future__ import annotations

import inspect
import itertools

import pytest

from moerl.config import load_config
from moerl.envs.base import BUILTIN_ENVS, Environment, StepResult, load_env_class

NUM_EVAL = 6
MAX_TURNS = 8
"""Turns an episode may take here: more than any built-in reference policy needs (guess: 5)."""


def _play(env, actions: list[str]) -> list[StepResult]:
    results = []
    for action in actions:
        result = env.step(action)
        assert isinstance(result, StepResult), "step returns a StepResult"
        assert isinstance(result.observation, str) and isinstance(result.done, bool)
        assert isinstance(result.reward, float | int) and all(
            isinstance(v, float) for v in result.info.values()
        )
        results.append(result)
        if result.done:
            break
    return results


def check_environment_contract(env_cls, cfg) -> None:
    """Assert the environment contract (module docstring) of ``env_cls`` under the ``EnvConfig`` ``cfg``."""
    task = env_cls.make_task(cfg, num_eval=NUM_EVAL, seed=0)
    held_out = task.eval_prompts()
    assert len(held_out) == NUM_EVAL, "make_task keeps num_eval held-out prompts"
    drawn = {p.text for p in itertools.islice(task.train_prompts(0), 200)}
    assert not drawn & {p.text for p in held_out}, "a held-out prompt is drawn for training"
    assert isinstance(env_cls.turn_stop, str) and env_cls.turn_stop, "turn_stop is one non-empty string"
    declared = list(inspect.signature(Environment.demonstration).parameters)
    assert list(inspect.signature(env_cls.demonstration).parameters) == declared, "demonstration(cfg, task)"
    for prompt in held_out:
        env = env_cls(cfg)
        try:
            assert isinstance(env.reset(prompt), str), "reset returns the first observation"
            results = _play(env, env_cls.demonstration(cfg, prompt))
        finally:
            env.close()
        assert results and results[-1].done, "the demonstration ends the episode"
        assert len(results) <= cfg.max_turns, "the demonstration fits env.max_turns"
        assert results[-1].info.get("correct") == 1.0, "the demonstration solves the task"
    env = env_cls(cfg)
    env.reset(held_out[0])
    _play(env, ["\x00 ??", "", "9" * 100])  # malformed actions: no exception
    env.close()


def _env_config(name: str):
    """The default ``EnvConfig`` of ``name`` with room for the reference policy (``MAX_TURNS``)."""
    return load_config(None, ["task.name=env", f"env.name={name}", f"env.max_turns={MAX_TURNS}"]).env


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_registered_environment_meets_the_contract(name):
    cfg = _env_config(name)
    check_environment_contract(load_env_class(cfg.import_path), cfg)


def test_an_environment_whose_demonstration_fails_is_refused():
    cfg = load_config(None, ["task.name=env", "env.name=calculator"]).env
    base = load_env_class(cfg.import_path)

    class Clumsy(base):
        @classmethod
        def demonstration(cls, cfg, task):
            return ["a -1"]

    with pytest.raises(AssertionError, match="solves the task"):
        check_environment_contract(Clumsy, cfg)
