"""Environment tasks as ``moerl.tasks.Task``s: prompts with a held-out split, demonstrations for the
warm start, and held-out evaluation by greedy episodes.

``EnvTask`` is what ``make_task`` returns for ``task.name: env``: the queue draws its training prompts,
``moerl sft`` fine-tunes on its demonstrations (observations masked out) and every stage's accuracy is
``evaluate_episodes`` (the share of held-out episodes whose final info says ``correct``). Its ``score``
is never used: episodes are scored by their environment.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moerl.envs.base import Environment
from moerl.envs.episodes import EpisodeEngine
from moerl.envs.pool import LocalEnvPool
from moerl.rollout import Engine, Request, SamplingParams
from moerl.tasks.base import GeneratedTask, Prompt, Reward
from moerl.tasks.eval import EvalResult
from moerl.tasks.examples import Example
from moerl.tasks.tokenizer import Tokenizer

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config_env import EnvConfig


def turn_stop_ids(tokenizer: Tokenizer, env_cls: type[Environment]) -> tuple[int, ...]:
    """The token ids that end a policy turn: eos and the environment's one-token ``turn_stop``.

    Raises:
        ValueError: ``turn_stop`` is not exactly one token of this tokenizer.
    """
    ids = tokenizer.encode(env_cls.turn_stop)
    if len(ids) != 1:
        raise ValueError(
            f"{env_cls.__name__}.turn_stop={env_cls.turn_stop!r} is {len(ids)} tokens of this tokenizer; it must be one"
        )
    return (tokenizer.eos_id, ids[0])


class EnvTask(GeneratedTask):
    """Prompts of an environment (``draw(rng) -> (problem key, Prompt)``), split train/eval by key hash."""

    def __init__(
        self,
        env_cls: type[Environment],
        cfg: EnvConfig,
        draw: Callable[[random.Random], tuple[str, Prompt]],
        *,
        name: str,
        num_eval: int,
        seed: int,
    ) -> None:
        super().__init__()
        self.env_cls, self.cfg, self.draw = env_cls, cfg, draw
        self.name, self.num_eval, self.seed = name, num_eval, seed

    def _draw(self, rng: random.Random) -> tuple[str, Prompt]:
        return self.draw(rng)

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """Not used: an episode's reward comes from its environment."""
        raise TypeError(f"{self.name}: environment tasks are scored by their environment (moerl.envs)")

    def make_env(self) -> Environment:
        """A fresh environment for one episode."""
        return self.env_cls(self.cfg)

    def sft_example(self, tokenizer: Tokenizer, prompt: Prompt) -> Example:
        """A demonstration played through the environment: the reset observation, then each action
        with its turn delimiter (loss 1) and each observation (loss 0), for at most ``env.max_turns``
        actions (a demonstration may fail)."""
        env = self.env_cls(dataclasses.replace(self.cfg, step_latency_s=0.0))  # no simulated tool latency
        ids = tokenizer.encode(env.reset(prompt))
        num_prompt = len(ids)
        mask = [0] * num_prompt
        actions = self.env_cls.demonstration(self.cfg, prompt)
        for action in actions[: self.cfg.max_turns]:
            a = tokenizer.encode(action + self.env_cls.turn_stop)
            ids, mask = ids + a, mask + [1] * len(a)
            obs, _, done, _ = env.step(action)
            if done:
                return Example(ids, num_prompt, tuple(mask))
            o = tokenizer.encode(obs)
            ids, mask = ids + o, mask + [0] * len(o)
        return Example(ids, num_prompt, tuple(mask))  # cut at env.max_turns: the episode fails there

    @torch.no_grad()
    def evaluate_episodes(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        prompts: list[Prompt],
        *,
        max_new_tokens: int = 16,
        max_slots: int = 64,
        kv_token_budget: int = 16384,
    ) -> EvalResult:
        """Greedy episodes on ``prompts`` with in-process environment workers.

        Accuracy is the mean final ``info["correct"]`` (``reward > 0`` when absent); an episode
        ended by an environment fault counts as wrong (``num_reward_errors``).
        """
        was_training = model.training
        model.eval()
        pool = LocalEnvPool(
            self.make_env,
            self.cfg.num_workers,
            step_timeout_s=self.cfg.step_timeout_s,
            max_pending_per_worker=self.cfg.max_pending_per_worker,
        )
        episodes = EpisodeEngine(
            Engine(model, max_slots=max_slots, kv_token_budget=kv_token_budget, cuda_graphs=False),
            pool,
            tokenizer.encode,
            tokenizer.decode,
            max_turns=self.cfg.max_turns,
            max_tokens=self.cfg.max_tokens,
            turn_stop_ids=turn_stop_ids(tokenizer, self.env_cls),
        )
        params = SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,)
        )
        pending = list(enumerate(prompts))
        done, errors = [], 0
        try:
            while pending or episodes.num_unfinished:
                while pending and episodes.num_unfinished < episodes.num_slots:
                    i, p = pending.pop(0)
                    episodes.bind_task(f"eval-{i}", p)
                    episodes.add_request(
                        Request(request_id=f"eval-{i}", prompt_ids=[tokenizer.eos_id], params=params)
                    )
                done += episodes.step()
                errors += len(episodes.pop_failed())
        finally:
            pool.close()
            model.train(was_training)
        correct = [c.reward_info.get("correct", float(c.reward > 0)) for c in done]
        n = len(prompts)
        return EvalResult(
            accuracy=sum(correct) / n,
            mean_reward=sum(c.reward for c in done) / n,
            num_prompts=n,
            mean_response_tokens=sum(len(c.token_ids) for c in done) / max(1, len(done)),
            num_reward_errors=errors,
        )
