"""The task interface: prompts with gold answers and a reward that never raises.

A task is the start of moerl's data flow (tasks -> rollout -> buffer -> trainer). It yields
``Prompt``s whose ``text`` is already templated (ready to tokenize) and scores a response with
``reward(prompt_text, response_text, answer, extra=None) -> Reward`` (or ``reward_many`` for a group).
Scoring is a plain Python callable (``moerl.tasks.rewards``); any exception it raises, or a call past
``task.reward_timeout_s``, is caught, counted and turned into ``Reward(0.0, {"error": 1.0})`` so that one
bad sample never stops a run.

Train and eval splits are disjoint by construction: every built-in task assigns each problem to
exactly one split with ``split_of(key)``, a hash of the problem's canonical key.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from moerl.tasks.rewards import RewardFunction

log = logging.getLogger(__name__)

EVAL_PERCENT = 10
"""Share of a generated task's problem space (percent, by key hash) reserved for evaluation."""

MAX_LOGGED_ERRORS = 5
"""Reward exceptions logged (one line each, the traceback at debug level) per task object; later ones are
only counted."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One problem, ready for generation.

    Attributes:
        id: stable identifier (same problem -> same id across runs and retries), e.g. ``"arith-3f2a..."``.
        text: the templated prompt string that is tokenized as-is, e.g. ``"12+34="``.
        answer: the gold answer passed to ``Task.reward``, e.g. ``"46"``.
        solution: a reference response for supervised warm start (``None`` when the task has none),
            e.g. ``"46"`` for arithmetic or ``"50+25"`` for countdown.
    """

    id: str
    text: str
    answer: str
    solution: str | None = None
    extra: dict[str, Any] | None = field(default=None, hash=False)
    """The columns of the prompt's dataset row that the task does not consume (JSON values: nested
    dicts and lists as they are), passed to a reward function that takes ``extra=``; None: none."""


@dataclass(frozen=True, slots=True)
class Reward:
    """The score of one response.

    Attributes:
        score: the scalar reward used by the RL objective (built-in tasks: 1.0 correct, else 0.0).
        info: named sub-scores, each a float: ``correct`` (0/1), ``format`` (0/1: the response has
            the expected shape), ``error`` (1 when the reward function raised), plus task-specific ones.
    """

    score: float
    info: dict[str, float] = field(default_factory=dict)


ScoreFn = Callable[..., "Reward | float | bool | int"]
"""A reward function ``(prompt_text, response_text, answer[, extra=dict]) -> Reward | float``, or a
``moerl.tasks.rewards.RewardFunction`` (batched, timed out)."""


def stable_hash(key: str) -> int:
    """A 64-bit hash of ``key`` that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def split_of(key: str) -> str:
    """``"eval"`` for ``EVAL_PERCENT`` % of problem keys (by stable hash), else ``"train"``."""
    return "eval" if stable_hash(key) % 100 < EVAL_PERCENT else "train"


def as_reward(value: Reward | float | bool | int) -> Reward:
    """Normalize what a reward function returned into a ``Reward``.

    Raises:
        TypeError: the value is neither a ``Reward`` nor a real number.
        ValueError: the score is NaN or infinite.
    """
    if isinstance(value, Reward):
        reward = value
    elif isinstance(value, numbers.Real):  # bool, int, float, and numpy / torch scalars such as np.float32
        reward = Reward(float(value), {})
    else:
        raise TypeError(f"reward function returned {type(value).__name__}; expected float or Reward")
    if not math.isfinite(reward.score):
        raise ValueError(f"reward function returned a non-finite score {reward.score!r}")
    return reward


class Task:
    """Base class of tasks: prompt iteration plus a guarded reward.

    Subclasses implement ``train_prompts``, ``eval_prompts`` and ``score``. A user reward function
    given as ``score_fn`` replaces ``score``. ``num_reward_errors`` counts the responses whose
    scoring raised (each one scored 0).
    """

    name: str = "task"
    has_verifier: bool = True
    """Whether ``score`` checks correctness (``Reward.info["correct"]``); False for a task whose only
    scoring is the user's reward function (``held_out_correct`` then returns None)."""

    def __init__(self, score_fn: ScoreFn | None = None) -> None:
        self._score_fn = None if score_fn is None else RewardFunction.of(score_fn)
        self.num_reward_errors = 0
        self.first_reward_error: str | None = None
        """``"<Type>: <message>"`` of the first reward failure, for the line that stops a run."""

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless, deterministic (given ``seed``) stream of training prompts."""
        raise NotImplementedError

    @property
    def max_train_prompts(self) -> int | None:
        """Most distinct training prompts the task has (a dataset's training rows; an upper bound for a
        generated task that knows its problem space), or None when unbounded or unknown."""
        return None

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (disjoint from every training prompt), in a fixed order."""
        raise NotImplementedError

    def eval_sets(self) -> dict[str, list[Prompt]]:
        """The held-out sets, name -> prompts, the first the main one (``eval/accuracy``); a task with one
        set: ``{"held_out": eval_prompts()}``. Names are the ``<name>`` of ``eval/<name>/...`` metrics."""
        return {"held_out": self.eval_prompts()}

    def score(self, prompt_text: str, response_text: str, answer: str) -> Reward:
        """The task's own verifier; may raise (``reward`` guards it)."""
        raise NotImplementedError

    def reward(self, prompt_text: str, response_text: str, answer: str, extra: dict | None = None) -> Reward:
        """Score one response; never raises (``reward_many`` of one sample).

        Returns:
            The verifier's ``Reward``; ``Reward(0.0, {"error": 1.0, "correct": 0.0})`` when it raised, took
            longer than ``task.reward_timeout_s`` or returned something that is not a finite number
            (``num_reward_errors`` grows by one).
        """
        return self.reward_many([prompt_text], [response_text], [answer], [extra])[0]

    def reward_many(
        self,
        prompt_texts: Sequence[str],
        response_texts: Sequence[str],
        answers: Sequence[str],
        extras: Sequence[dict | None],
    ) -> list[Reward]:
        """Score B responses (a group, or a held-out set); never raises.

        A batched reward function (``task.reward_batched``) gets one call with the B-long lists: if it fails,
        all B samples count as failed; otherwise each sample is one guarded call. The task's own verifier is
        called per sample.

        Returns:
            B ``Reward``s, in order (a failed one as ``reward`` says).
        """
        fn = self._score_fn
        rows = list(zip(prompt_texts, response_texts, answers, extras, strict=True))
        if fn is not None and fn.batched:
            try:
                values = fn.call_batch(*(list(c) for c in zip(*rows, strict=True)))
                return [as_reward(v) for v in values]
            except Exception as e:  # noqa: BLE001 - a reward bug must cost the batch, not the run
                return [self._failed(e, prompt_texts[0]) for _ in rows]
        out = []
        for prompt_text, response_text, answer, extra in rows:
            try:
                value = (
                    fn.call_one(prompt_text, response_text, answer, extra)
                    if fn is not None
                    else self.score(prompt_text, response_text, answer)
                )
                out.append(as_reward(value))
            except Exception as e:  # noqa: BLE001 - a reward bug must cost one sample, not the run
                out.append(self._failed(e, prompt_text))
        return out

    def _failed(self, e: Exception, prompt_text: str) -> Reward:
        """Count and log (the first ``MAX_LOGGED_ERRORS``) one failed reward; its ``Reward``."""
        self.num_reward_errors += 1
        if self.first_reward_error is None:
            self.first_reward_error = f"{type(e).__name__}: {e}"
        if self.num_reward_errors <= MAX_LOGGED_ERRORS:  # one line each; the traceback at debug level
            log.warning("reward function raised on prompt %r: %s: %s", prompt_text[:80], type(e).__name__, e)
            log.debug("reward function traceback", exc_info=e)
        return Reward(0.0, {"error": 1.0, "correct": 0.0})

    def explain_failure(
        self, prompt_text: str, response_text: str, answer: str, extra: dict | None = None
    ) -> str | None:
        """Score one response again, unguarded, and say why it fails (``"ValueError: boom"``,
        ``"returned str '1.0', not a number"``), or None when it scores. For the line that stops a run."""
        fn = self._score_fn
        try:
            if fn is None:
                as_reward(self.score(prompt_text, response_text, answer))
            elif fn.batched:
                as_reward(fn.call_batch([prompt_text], [response_text], [answer], [extra])[0])
            else:
                as_reward(fn.call_one(prompt_text, response_text, answer, extra))
        except Exception as e:  # noqa: BLE001 - the failure is what is asked for
            return f"{type(e).__name__}: {e}"
        return None

    def held_out_correct(
        self, prompt_text: str, response_text: str, answer: str, reward: Reward
    ) -> float | None:
        """Whether a response is correct (1.0 or 0.0), for held-out exact match; never from ``score > 0``.

        The reward's own ``info["correct"]`` when it reports one (built-in verifiers do, and so does a user
        reward returning ``Reward(score, {"correct": ...})``); else, when a user reward function replaced
        a task that has a verifier (``has_verifier``), the verifier's verdict; else None (no notion of
        correctness: evaluation reports the mean held-out reward instead).
        """
        if "correct" in reward.info:
            return float(reward.info["correct"])
        if not self.has_verifier or self._score_fn is None:
            return None
        try:
            return float(as_reward(self.score(prompt_text, response_text, answer)).info.get("correct", 0.0))
        except Exception:  # noqa: BLE001 - the built-in verifiers do not raise; a broken one is "not correct"
            return 0.0


def score_many(
    task: Any,
    prompt_texts: Sequence[str],
    response_texts: Sequence[str],
    answers: Sequence[str],
    extras: Sequence[dict | None],
) -> list[Reward]:
    """``task.reward_many(...)`` of a ``Task``; for an object with only ``reward(prompt_text, response_text,
    answer)`` (the scoring contract of the rollout worker and the eval), one such call per sample."""
    many = getattr(task, "reward_many", None)
    if many is not None:
        return list(many(prompt_texts, response_texts, answers, extras))
    return [task.reward(p, r, a) for p, r, a in zip(prompt_texts, response_texts, answers, strict=True)]


class GeneratedTask(Task):
    """A task whose problems are drawn from a seeded generator and split train/eval by ``split_of``.

    Subclasses set ``name`` and ``num_eval``/``seed`` and implement ``_draw(rng) -> (key, Prompt)``,
    where ``key`` identifies the problem (two draws with one key are the same problem).
    """

    num_eval: int
    seed: int

    def _draw(self, rng: random.Random) -> tuple[str, Prompt]:
        raise NotImplementedError

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless training problems drawn with ``random.Random(seed)``; eval-split problems skipped."""
        rng = random.Random(f"{self.name}-train-{seed}")
        while True:
            key, prompt = self._draw(rng)
            if split_of(key) == "train":
                yield prompt

    def eval_prompts(self) -> list[Prompt]:
        """Up to ``num_eval`` distinct eval-split problems, drawn like training ones (fixed by ``seed``).

        Raises:
            ValueError: the eval split of this problem space is empty.
        """
        rng = random.Random(f"{self.name}-eval-{self.seed}")
        found: dict[str, Prompt] = {}
        for _ in range(50 * self.num_eval):
            key, prompt = self._draw(rng)
            if split_of(key) == "eval":
                found.setdefault(key, prompt)
                if len(found) == self.num_eval:
                    break
        if not found:
            raise ValueError(f"the {self.name} eval split is empty; widen the task's problem space")
        return list(found.values())
