"""The data plane's two stores built from a run's config: the task queue and the experience buffer.

Apart from ``moerl.runtime.build`` (which re-exports both) because the exchange actor builds only these:
this module imports no model, engine or torch, so the actor's process starts without them.
"""

from __future__ import annotations

from moerl.config import RunConfig
from moerl.placement import Placement
from moerl.runtime.buffer import ExperienceBuffer, has_reward_variance
from moerl.runtime.queue import TaskQueue
from moerl.tasks import Task, Tokenizer


def make_queue(cfg: RunConfig, task: Task, tokenizer: Tokenizer) -> TaskQueue:
    """The task queue over the task's endless, seeded training prompts (one task = one group)."""
    return TaskQueue(
        task.train_prompts(cfg.task.seed + cfg.seed),
        num_samples=cfg.rollout.group_size,
        tokenize=tokenizer.encode,
        max_materialized=cfg.runtime.max_materialized_tasks,
    )


def is_dynamic_sampling(cfg: RunConfig) -> bool:
    """Whether the run's loss preset filters groups without reward variance (DAPO dynamic sampling):
    ``moerl.rl.preset_from_config(cfg.algorithm).dynamic_sampling``. Imports ``moerl.rl`` (and torch):
    the driver calls it and hands the answer to the exchange actor."""
    from moerl.rl import preset_from_config

    return preset_from_config(cfg.algorithm).dynamic_sampling


def make_buffer(
    cfg: RunConfig, queue: TaskQueue, *, version: int = 0, dynamic_sampling: bool | None = None
) -> ExperienceBuffer:
    """The experience buffer: capacity, staleness rule (``Placement.rollout.max_staleness``: 0 when the
    rollouts run in the driver, generate-then-train), DAPO filter (``dynamic_sampling``, None:
    ``is_dynamic_sampling(cfg)``), queue settlement."""
    if dynamic_sampling is None:
        dynamic_sampling = is_dynamic_sampling(cfg)
    filters = (has_reward_variance,) if dynamic_sampling else ()
    max_staleness = Placement.from_config(cfg).rollout.max_staleness
    return ExperienceBuffer(
        max(cfg.runtime.buffer_groups, cfg.trainer.batch_groups),
        max_staleness=max_staleness,
        stale_policy=cfg.runtime.stale_policy,
        filters=filters,
        settle=queue.settle,
        requeue=queue.requeue,
        initial_version=version,
    )
