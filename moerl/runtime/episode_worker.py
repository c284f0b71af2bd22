"""The rollout worker for environment tasks: the same lease -> generate -> deliver loop as
``moerl.runtime.worker.RolloutWorker``, with an ``EpisodeEngine`` in place of the engine.

Differences, each a small override:
- every lease binds its task to the episode engine (``_params``), which resets the environments;
- a sample's reward is the episode's (the environment's per-turn rewards), its prompt the reset
  observation and its loss mask the episode's policy mask (``_to_sample``);
- a group with an environment fault is not delivered: its lease goes back to the queue
  (``TaskQueue.release``: the task is pending again, leased anew with a fresh fencing token, so it is
  trained at most once) and the fault is counted (``step``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from moerl.envs.episodes import EpisodeCompletion, EpisodeEngine
from moerl.envs.pool import LocalEnvPool
from moerl.envs.stats import EnvStats
from moerl.envs.task import turn_stop_ids
from moerl.placement import RAY_ACTORS, Placement
from moerl.records import Lease, Sample
from moerl.rollout import Completion, SamplingParams
from moerl.runtime.worker import RolloutWorker, WorkerStats
from moerl.tasks.base import Prompt

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EpisodeWorkerStats(WorkerStats):
    """``WorkerStats`` plus the environment figures and the groups requeued after a fault."""

    env: EnvStats = field(default_factory=EnvStats)
    """Environment calls, faults, latencies, parked episodes (``moerl.envs.stats``)."""
    groups_failed: int = 0
    """Groups not delivered because an episode hit an environment fault (their leases released)."""


class EpisodeWorker(RolloutWorker):
    """A ``RolloutWorker`` whose engine is an ``EpisodeEngine`` (arguments as ``RolloutWorker``)."""

    engine: EpisodeEngine
    continues_prefixes = False  # an episode's environment state is not in its token prefix

    def __init__(self, worker_id: str, engine: EpisodeEngine, *args, **kwargs) -> None:
        super().__init__(worker_id, engine, *args, **kwargs)
        self.stats = EpisodeWorkerStats(worker_id=worker_id, env=engine.stats)

    def _params(self, lease: Lease) -> SamplingParams:
        # RolloutWorker._lease_more names the request f"{task_id}#{token}" right before calling this
        task = lease.task
        self.engine.bind_task(
            f"{lease.task_id}#{lease.token}",
            Prompt(id=task.task_id, text=task.prompt_text, answer=task.answer),
        )
        return super()._params(lease)

    def _score(self, lease: Lease, completions: list[Completion]) -> list[None]:
        return [None] * len(completions)  # an episode's reward comes with it (``EpisodeCompletion.reward``)

    def _to_sample(self, lease: Lease, c: Completion, reward=None) -> Sample:
        if not isinstance(c, EpisodeCompletion):
            raise TypeError(f"EpisodeWorker got a {type(c).__name__} for {c.request_id}; expected an episode")
        return Sample(
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            response_logprobs=c.logprobs,
            loss_mask=c.loss_mask,
            finish_reason=c.finish_reason,
            policy_versions=c.policy_versions,
            reward=c.reward,
            reward_info=dict(c.reward_info),
        )

    def step(self, budget: int | None = None):
        """``RolloutWorker.step``, then the groups ended by an environment fault go back to the queue."""
        results = super().step(budget)
        for request_id, reason in self.engine.pop_failed().items():
            job = self._in_flight.get(request_id)
            if job is None:
                continue
            released = self.abandon(job.lease.task_id)
            self.stats.groups_failed += 1
            log.warning(
                "worker %s: task %s ended by an environment fault (%s); %s",
                self.worker_id,
                job.lease.task_id,
                reason,
                "requeued" if released else "lease no longer current",
            )
        return results


def episode_worker(
    cfg, worker_id: str, engine, task, tokenizer, queue, buffer, weights, *, pause_point=None
) -> EpisodeWorker:
    """The ``EpisodeWorker`` of a run config (``cfg.env``): in-process environment threads in sync mode,
    Ray environment actors in async mode (``moerl.envs.pool_ray``), over ``engine``; ``pause_point`` as
    ``RolloutWorker``'s."""
    if Placement.from_config(cfg).env_runs_on == RAY_ACTORS:
        from moerl.envs.pool_ray import RayEnvPool  # noqa: PLC0415 - ray is optional and heavy

        pool = RayEnvPool(task.env_cls, cfg.env)
    else:
        pool = LocalEnvPool(
            task.make_env,
            cfg.env.num_workers,
            step_timeout_s=cfg.env.step_timeout_s,
            max_pending_per_worker=cfg.env.max_pending_per_worker,
        )
    episodes = EpisodeEngine(
        engine,
        pool,
        tokenizer.encode,
        tokenizer.decode,
        max_turns=cfg.env.max_turns,
        max_tokens=cfg.env.max_tokens,
        turn_stop_ids=turn_stop_ids(tokenizer, task.env_cls),
    )
    return EpisodeWorker.from_run_config(
        cfg, worker_id, episodes, task, tokenizer, queue, buffer, weights, pause_point=pause_point
    )
