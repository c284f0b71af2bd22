"""The environment interface: ``reset(task) -> observation``, ``step(action_text) -> observation,
reward, done, info`` (the shape of Gym and of the agentic RL frameworks), and its registry.

An ``Environment`` holds the state of one episode. A class is registered by import path
(``env.name = "package.module:Class"``, like ``task.reward_fn``) or by a built-in name
(``BUILTIN_ENVS``). Each class also says where its tasks come from
(``make_task``: training prompts and a held-out split) and how a reference policy plays them
(``demonstration``: the warm start's supervised data).
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, NamedTuple

from moerl.tasks.base import Prompt

if TYPE_CHECKING:
    from moerl.config_env import EnvConfig
    from moerl.envs.task import EnvTask

BUILTIN_ENVS: dict[str, str] = {
    "calculator": "moerl.envs.calculator:CalculatorEnv",
    "guess": "moerl.envs.guess:GuessEnv",
}
"""The built-in environments: ``env.name`` -> the import path of its class (``load_env_class``); the
config's choice of names is this table's keys."""


class StepResult(NamedTuple):
    """What ``Environment.step`` returns; unpacks as ``observation, reward, done, info``."""

    observation: str
    """Text appended to the context after the action (masked out of the loss); ignored when done."""
    reward: float
    """Reward of this turn; an episode's reward is the sum over its turns (per-turn or at the end)."""
    done: bool
    """True when the episode is over."""
    info: dict[str, float]
    """Named figures (e.g. ``correct`` 0/1, ``format`` 0/1); the last turn's info is the episode's."""


class EnvContractError(RuntimeError):
    """An environment broke its contract (a non-string observation, a non-finite reward, ...)."""


class Environment:
    """One episode of a multi-turn task. Subclasses implement ``reset`` and ``step``.

    Class-level hooks (``make_task``, ``demonstration``) describe the task family; an instance is
    created per episode (``cls(cfg)``) inside an environment worker and may be slow, block or raise:
    the worker turns any of these into an episode error instead of a crash.
    """

    turn_stop: str = "\n"
    """Text that ends a policy turn (besides eos); it must be one token of the tokenizer."""

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg

    @classmethod
    def make_task(cls, cfg: EnvConfig, *, num_eval: int, seed: int) -> EnvTask:
        """The prompts of this environment: an endless training stream and ``num_eval`` held-out ones."""
        raise NotImplementedError

    @classmethod
    def demonstration(cls, cfg: EnvConfig, task: Prompt) -> list[str]:
        """The actions of a reference policy on ``task``, each without its turn delimiter; used for the
        supervised warm start (``EnvTask.sft_example`` calls it so)."""
        raise NotImplementedError

    def reset(self, task: Prompt) -> str:
        """Start an episode on ``task``; returns the first observation (the prompt the policy sees)."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """Apply the policy's action text (its turn delimiter stripped)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the episode's resources (called once when it ends, errors included)."""


def load_env_class(path: str) -> type[Environment]:
    """The ``Environment`` subclass at ``package.module:Class`` (the registry is the import system).

    Raises:
        ValueError: ``path`` is not ``module:Class``, or the object is not an ``Environment`` subclass.
        ImportError, AttributeError: the module or the class does not exist.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"env.name={path!r}: expected an import path 'package.module:Class'")
    obj = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise ValueError(f"env.name={path!r} is {obj!r}, not a subclass of moerl.envs.Environment")
    return obj


def checked_result(value) -> StepResult:
    """``value`` as a ``StepResult`` (a 4-tuple is accepted).

    Raises:
        EnvContractError: not a 4-tuple, a non-string observation, a non-finite reward, a non-dict info.
    """
    if not isinstance(value, tuple) or len(value) != 4:
        raise EnvContractError(
            f"step() returned {type(value).__name__}; expected (observation, reward, done, info)"
        )
    obs, reward, done, info = value
    if not isinstance(obs, str):
        raise EnvContractError(f"step() observation is {type(obs).__name__}, not str")
    if not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvContractError(f"step() reward {reward!r} is not a finite number")
    if not isinstance(info, dict):
        raise EnvContractError(f"step() info is {type(info).__name__}, not dict")
    return StepResult(obs, float(reward), bool(done), {str(k): float(v) for k, v in info.items()})
