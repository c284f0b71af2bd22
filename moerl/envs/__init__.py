"""Multi-turn environments: the interface, environment workers, episodes on the rollout engine.

- ``Environment``: ``reset(task) -> observation``, ``step(action_text) -> StepResult(observation,
  reward, done, info)``; registered by import path (``load_env_class``).
- Built-ins: ``moerl.envs.calculator.CalculatorEnv`` (tool-use arithmetic with a safe calculator) and
  ``moerl.envs.guess.GuessEnv`` (higher/lower guessing game).
- ``LocalEnvPool`` / ``moerl.envs.pool_ray.RayEnvPool``: environment workers (threads / Ray actors).
- ``EpisodeEngine``: episodes over ``moerl.rollout.Engine``; ``EpisodeWorker``: the rollout worker for them.

Design notes: ``moerl/envs/README.md``.
"""

import importlib

_MODULE_OF = {
    "EnvCall": "pool",
    "EnvContractError": "base",
    "EnvReply": "pool",
    "EnvStats": "stats",
    "Environment": "base",
    "EpisodeCompletion": "episodes",
    "EpisodeEngine": "episodes",
    "LocalEnvPool": "pool",
    "StepResult": "base",
    "load_env_class": "base",
}
"""Each public name's module: resolved on first access (PEP 562), so that an environment worker actor
(``pool_ray.py``), which imports one module of the package, never loads the engine and torch that
``episodes.py`` needs."""

__all__ = [
    "EnvCall",
    "EnvContractError",
    "EnvReply",
    "EnvStats",
    "Environment",
    "EpisodeCompletion",
    "EpisodeEngine",
    "LocalEnvPool",
    "StepResult",
    "load_env_class",
]


def __getattr__(name: str):
    """``moerl.envs.<name>`` of ``__all__``, imported from its module on first access.

    Raises:
        AttributeError: ``name`` is not one of the package's names.
    """
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
