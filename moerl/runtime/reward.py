"""Learned reward scoring of completed groups, between the rollout worker and the experience buffer.

    RolloutWorker --put_many--> [score_groups: RewardScorer + reward.combine] --> ExperienceBuffer

A group's samples leave the worker scored by the task's verifier; ``score_groups`` has a
``RewardScorer`` score every sample's prompt + response with the reward model (``reward.model_path``),
then the training reward becomes ``moerl.rl.reward_mix.mix_rewards`` of the two
(``reward.combine``, ``reward.normalize``); ``reward_info`` keeps both (``verifiable``, ``model_score``).
The group, its lease token and everything else are unchanged, so the buffer's exactly-once rules hold
as before: scoring happens while the lease is held (the worker keeps heartbeating it) and a group that
arrives after its lease ended is refused by its fencing token as any late delivery is.

Two scorers implement ``RewardScorer``: ``LocalRewardScorer`` (sync mode: the model in this process;
``ScoringSink`` wraps the buffer the worker delivers to) and ``moerl.runtime.ray.reward_pool.RayRewardPool``
(async mode: reward worker actors, called by the exchange actor before its buffer).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from moerl.models.dtypes import torch_dtype
from moerl.models.reward_model import RewardModel, load_reward_model, score_sequences
from moerl.records import Group, Pending
from moerl.rl.reward_mix import mix_rewards
from moerl.runtime.delivery import GroupSink

if TYPE_CHECKING:
    from moerl.config_reward import RewardConfig

REWARD_KEYS: tuple[str, ...] = (
    "reward/latency_s",
    "reward/batch_size",
    "reward/score_mean",
    "reward/score_std",
    "reward/retries",
    "reward/workers_lost",
)
"""The metrics of reward scoring (``RewardStats.take``), in ``moerl.telemetry.metrics.METRIC_KEYS``."""


@dataclass
class RewardStats:
    """Counters of a scorer: the window since the last ``take`` and cumulative losses. Thread-safe."""

    batches: int = 0
    sequences: int = 0
    latency_s: float = 0.0
    score_sum: float = 0.0
    score_sq_sum: float = 0.0
    retries: int = 0
    """Batches scored again after a lost or timed-out worker (cumulative)."""
    workers_lost: int = 0
    """Reward workers that died or timed out and were replaced (cumulative)."""
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add_batch(self, scores: list[float], latency_s: float) -> None:
        """Record one scored batch: its scores and its wall seconds from submission to result."""
        with self._lock:
            self.batches += 1
            self.sequences += len(scores)
            self.latency_s += latency_s
            self.score_sum += sum(scores)
            self.score_sq_sum += sum(s * s for s in scores)

    def add_loss(self, *, lost_worker: bool) -> None:
        """Record a batch to score again (and whether a worker was lost with it)."""
        with self._lock:
            self.retries += 1
            self.workers_lost += int(lost_worker)

    def take(self) -> dict[str, float | None]:
        """The ``REWARD_KEYS`` values since the previous ``take`` (None: no batch since), then a new
        window: mean seconds per batch, mean sequences per batch, score mean and std over the
        sequences; retries and workers lost are cumulative."""
        with self._lock:
            n, b = self.sequences, self.batches
            mean = self.score_sum / n if n else None
            var = max(self.score_sq_sum / n - mean * mean, 0.0) if n else None
            out = {
                "reward/latency_s": self.latency_s / b if b else None,
                "reward/batch_size": n / b if b else None,
                "reward/score_mean": mean,
                "reward/score_std": math.sqrt(var) if var is not None else None,
                "reward/retries": float(self.retries),
                "reward/workers_lost": float(self.workers_lost),
            }
            self.batches = self.sequences = 0
            self.latency_s = self.score_sum = self.score_sq_sum = 0.0
            return out


class RewardScorer(Protocol):
    """Scores token-id sequences with the reward model; ``stats`` counts its batches."""

    stats: RewardStats

    def score(self, sequences: list[list[int]]) -> list[float]:
        """One float score per sequence (prompt + response ids), in order.

        Raises:
            RuntimeError: a batch could not be scored within ``reward.max_attempts`` tries (async).
        """
        ...


class LocalRewardScorer:
    """The reward model in this process (sync mode), ``batch_size`` sequences per forward.

    Args:
        model: the loaded reward model (``moerl.models.reward_model.load_reward_model``).
        batch_size: sequences per forward.
    """

    def __init__(self, model: RewardModel, batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        self.stats = RewardStats()

    @classmethod
    def from_config(cls, cfg: RewardConfig, device: str) -> LocalRewardScorer:
        """Load ``cfg.model_path`` on ``device`` in ``cfg.dtype``."""
        model = load_reward_model(cfg.model_path, dtype=torch_dtype(cfg.dtype), device=device)
        return cls(model, cfg.batch_size)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """``score_sequences`` in batches of ``batch_size``, each timed into ``stats``."""
        out: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            t0 = time.perf_counter()
            scores = score_sequences(
                self.model, sequences[start : start + self.batch_size], batch_size=self.batch_size
            )
            self.stats.add_batch(scores, time.perf_counter() - t0)
            out += scores
        return out


def group_sequences(groups: list[Group]) -> list[list[int]]:
    """Every sample's prompt + response token ids, group by group (G x N lists)."""
    return [list(s.prompt_ids) + list(s.response_ids) for g in groups for s in g.samples]


def score_groups(groups: list[Group], scorer: RewardScorer, cfg: RewardConfig) -> list[Group]:
    """The groups with their samples' rewards mixed with the reward model's scores (module docstring).

    Groups of different sizes are normalized group by group (``reward.normalize: batch`` over all).
    ``reward_info`` of each sample gains ``verifiable`` (the task's reward) and ``model_score`` (raw).
    """
    if not groups:
        return []
    flat = scorer.score(group_sequences(groups))
    out, at = [], 0
    batch_norm = cfg.normalize == "batch"
    all_scores = torch.tensor(flat, dtype=torch.float32)
    if batch_norm:  # normalize once over every sample, then combine per group with no further normalization
        from moerl.rl.reward_mix import NORMALIZATIONS

        all_scores = NORMALIZATIONS["batch"](all_scores[None])[0]
    for g in groups:
        n = len(g.samples)
        raw, scores = flat[at : at + n], all_scores[at : at + n]
        at += n
        verifiable = torch.tensor([g.rewards], dtype=torch.float32)
        mixed = mix_rewards(
            verifiable,
            scores[None],
            combine=cfg.combine,
            normalize="none" if batch_norm else cfg.normalize,
            task_weight=cfg.task_weight,
            model_weight=cfg.model_weight,
        )[0].tolist()
        samples = tuple(
            dataclasses.replace(
                s, reward=r, reward_info={**s.reward_info, "verifiable": s.reward, "model_score": m}
            )
            for s, r, m in zip(g.samples, mixed, raw, strict=True)
        )
        out.append(dataclasses.replace(g, samples=samples))
    return out


class ScoringSink:
    """A ``GroupSink`` that scores each delivery (``score_groups``) before handing it to ``sink``.

    Args:
        sink: the buffer (sync mode: the ``ExperienceBuffer``, whose call is done when it returns).
        scorer: the reward model's scorer.
        cfg: the run's ``reward`` section.
    """

    def __init__(self, sink: GroupSink, scorer: RewardScorer, cfg: RewardConfig) -> None:
        self.sink, self.scorer, self.cfg = sink, scorer, cfg

    def put_many_async(self, groups: list[Group], *, timeout: float | None = None) -> Pending:
        """Score ``groups``, then ``sink.put_many_async`` them."""
        return self.sink.put_many_async(score_groups(groups, self.scorer, self.cfg), timeout=timeout)
