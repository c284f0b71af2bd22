"""Reward workers of async mode: Ray actors holding the reward model, fed batches by the exchange actor.

    RolloutWorkerActor --put_many--> ExchangeActor --score (batches)--> RewardWorkerActor x reward.num_workers
                                       [score_groups -> ExperienceBuffer]

The exchange scores a delivery before its buffer takes it (``moerl.runtime.reward.score_groups``), so a
rollout worker never waits on the reward model: its delivery is an outstanding call while it keeps
decoding. ``RayRewardPool.score`` cuts the sequences into ``reward.batch_size`` batches and spreads them
over the workers round robin (deliveries of several rollout workers run at once, in the exchange's
threads).

Reliability: a batch whose worker died (its actor is gone: killed, OOM, node lost) or that took more than
``reward.timeout_s`` is scored again on the worker that replaces it (the late one is killed), up to
``reward.max_attempts`` tries; then the delivery fails and its groups go back to the rollout worker's
outbox. Scoring holds no task state: the group's lease stays with the rollout worker, which keeps
heartbeating it, and the buffer settles it by its fencing token as before, so a rescored batch cannot
train a task twice and a lost one is not lost.

Resources: ``num_cpus=reward.cpus_per_worker``; ``num_gpus=reward.gpus_per_worker`` when ``model.device``
is CUDA (a fraction shares one GPU); the custom resource ``reward`` (0.001) when the cluster defines it
(a reward node group, ``moerl cluster render``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from moerl.runtime.reward import LocalRewardScorer, RewardStats

if TYPE_CHECKING:
    from moerl.config import RunConfig
    from moerl.config_reward import RewardConfig


class RewardWorkerActor:
    """One reward worker: the reward model on its device (plain class; ``RayRewardPool`` wraps it).

    Args:
        cfg: the run's ``reward`` section (model folder, dtype, batch size).
        device: ``cpu`` or ``cuda``.
    """

    def __init__(self, cfg: RewardConfig, device: str) -> None:
        torch.set_num_threads(int(os.environ.get("MOERL_ACTOR_THREADS", "1")))
        self.scorer = LocalRewardScorer.from_config(cfg, device)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """Scores of token-id sequences (``LocalRewardScorer.score``)."""
        return self.scorer.score(sequences)

    def pid(self) -> int:
        """This worker's process id."""
        return os.getpid()


def rollout_gpu_share(total_gpus: float, num_rollout_workers: int, reward_gpus: float) -> float:
    """GPUs each rollout worker asks Ray for on CUDA beside reward workers that ask ``reward_gpus`` in all.

    1 when the machine holds both; else (one GPU: the commonest case) the GPUs the reward workers leave,
    split evenly, so that both schedule and share the GPU's memory and time.

    Raises:
        ValueError: the reward workers alone ask for every GPU (``reward.gpus_per_worker`` too large).
    """
    if total_gpus >= num_rollout_workers + reward_gpus:
        return 1.0
    left = total_gpus - reward_gpus
    if left <= 0:
        raise ValueError(
            f"the reward workers ask for {reward_gpus:g} of the {total_gpus:g} GPUs and leave none to the rollout "
            "workers; lower reward.gpus_per_worker (e.g. 0.25) or reward.num_workers"
        )
    return left / num_rollout_workers


def _resources(name: str) -> dict[str, float]:
    import ray

    return {name: 0.001} if name in ray.cluster_resources() else {}


class RayRewardPool:
    """``reward.num_workers`` reward worker actors and the batches in flight on them; a ``RewardScorer``.

    Thread-safe: the exchange's threads call ``score`` at once.

    Args:
        cfg: the run's ``reward`` section.
        device: where the workers run the model (``cpu`` or ``cuda``).
    """

    def __init__(self, cfg: RewardConfig, device: str) -> None:
        import ray

        self.cfg, self.device = cfg, device
        gpus = cfg.gpus_per_worker if device.startswith("cuda") else 0
        self._cls = ray.remote(
            num_cpus=cfg.cpus_per_worker, num_gpus=gpus, max_concurrency=1, resources=_resources("reward")
        )(RewardWorkerActor)
        self._lock = threading.Lock()
        self._actors = [self._spawn() for _ in range(cfg.num_workers)]
        self._next = 0
        self.stats = RewardStats()

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RayRewardPool:
        """Reward workers on CUDA when the policy is (``model.device``), else on CPU."""
        return cls(cfg.reward, "cuda" if cfg.model.device.startswith("cuda") else "cpu")

    def _spawn(self):
        return self._cls.remote(self.cfg, self.device)

    def _submit(self, chunk: list[list[int]]):
        with self._lock:
            slot = self._next % len(self._actors)
            self._next += 1
            handle = self._actors[slot]
        return handle.score.remote(chunk), slot, handle

    def _replace(self, slot: int, handle, *, kill: bool) -> None:
        """Replace the worker at ``slot`` unless another thread already did."""
        import ray

        with self._lock:
            if self._actors[slot] is not handle:
                self.stats.add_loss(lost_worker=False)
                return
            if kill:
                ray.kill(handle, no_restart=True)
            self._actors[slot] = self._spawn()
        self.stats.add_loss(lost_worker=True)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """One score per sequence, in order (module docstring: batches, retries, timeouts).

        Raises:
            RuntimeError: a batch failed ``reward.max_attempts`` times (lost or timed-out workers).
            ray.exceptions.RayTaskError: the model raised on a batch (e.g. a token id outside its
                vocabulary); not retried, since another worker would raise the same.
        """
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        bs = self.cfg.batch_size
        chunks = [sequences[i : i + bs] for i in range(0, len(sequences), bs)]
        results: list[list[float] | None] = [None] * len(chunks)
        pending = {}  # ref -> (chunk index, slot, handle, submit time, attempt)
        for i, chunk in enumerate(chunks):
            ref, slot, handle = self._submit(chunk)
            pending[ref] = (i, slot, handle, time.monotonic(), 1)
        while pending:
            deadline = min(t0 for _, _, _, t0, _ in pending.values()) + self.cfg.timeout_s
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            now = time.monotonic()
            for ref in ready:
                i, slot, handle, t0, attempt = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    self.stats.add_batch(results[i], now - t0)
                except (RayActorError, ActorUnavailableError) as e:
                    self._replace(slot, handle, kill=False)
                    self._retry(pending, chunks, i, attempt, f"reward worker lost ({type(e).__name__})")
            for ref, (i, slot, handle, t0, attempt) in list(pending.items()):
                if now - t0 >= self.cfg.timeout_s:
                    del pending[ref]
                    self._replace(slot, handle, kill=True)
                    self._retry(pending, chunks, i, attempt, f"timed out after {self.cfg.timeout_s} s")
        return [s for r in results for s in r]

    def _retry(self, pending: dict, chunks: list, i: int, attempt: int, why: str) -> None:
        if attempt >= self.cfg.max_attempts:
            raise RuntimeError(
                f"a reward batch of {len(chunks[i])} sequences failed {attempt} times "
                f"(reward.max_attempts={self.cfg.max_attempts}); last: {why}"
            )
        ref, slot, handle = self._submit(chunks[i])
        pending[ref] = (i, slot, handle, time.monotonic(), attempt + 1)

    def pids(self) -> list[int]:
        """Process ids of the current workers (waits for workers still starting)."""
        import ray

        with self._lock:
            actors = list(self._actors)
        return ray.get([a.pid.remote() for a in actors])

    def close(self) -> None:
        """Kill every worker."""
        import ray

        with self._lock:
            for a in self._actors:
                ray.kill(a)
