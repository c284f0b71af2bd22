"""Multi-turn environments: the interface, environment workers, episodes on the rollout engine.

- ``Environment``: ``reset(task) -> observation``, ``step(action_text) -> StepResult(observation,
  reward, done, info)``; registered by import path (``load_env_class``).
- Built-ins: ``moerl.envs.calculator.CalculatorEnv`` (tool-use arithmetic with a safe calculator) and
  ``moerl.envs.guess.GuessEnv`` (higher/lower guessing game).
- ``LocalEnvPool`` / ``moerl.envs.pool_ray.RayEnvPool``: environment workers (threads / Ray actors).
- ``EpisodeEngine``: episodes over ``moerl.rollout.Engine``; ``EpisodeWorker``: the rollout worker for them.

Design notes: ``moerl/envs/README.md``.
"""

from moerl.envs.base import EnvContractError, Environment, StepResult, load_env_class
from moerl.envs.episodes import EpisodeCompletion, EpisodeEngine
from moerl.envs.pool import EnvCall, EnvReply, LocalEnvPool
from moerl.envs.stats import EnvStats

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
