"""Building a run's parts from its config: warm start, policy, fleet, eval, and the final accounting.

Shared by the controller (driver process) and the Ray actors (which build their own worker, queue
and buffer from the same config in their own process).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from moerl.config import ConfigError, RunConfig
from moerl.envs.worker import episode_worker
from moerl.models import build_model, from_pretrained
from moerl.rollout import Engine
from moerl.runtime.buffer import BufferMetrics, ExperienceBuffer, has_reward_variance
from moerl.runtime.queue import QueueStats, TaskQueue
from moerl.runtime.run_dir import LedgerEntry, RunDir
from moerl.runtime.weights import WeightStore
from moerl.runtime.worker import RolloutWorker
from moerl.runtime.worker_local import LocalFleet, LocalWeights
from moerl.tasks import Task, Tokenizer, load_tokenizer, make_task
from moerl.tasks.tokenizer import tokenizer_path_for

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def warm_start(cfg: RunConfig, run: RunDir, view) -> str | None:
    """The checkpoint RL starts from: ``cfg.init_from``, else an SFT warm start in ``RUN_DIR/sft``.

    The SFT checkpoint is reused when it already exists (resume).
    """
    if cfg.init_from is not None:
        if not (Path(cfg.init_from) / "config.json").exists():
            raise ConfigError(
                f"init_from={cfg.init_from!r} is not a Hugging Face model folder (no config.json)"
            )
        return cfg.init_from
    out = run.path / "sft"
    if not (out / "config.json").exists():
        from moerl.tasks.sft import run_sft

        view.message(f"warm start: SFT for {cfg.sft.steps} steps -> {out}")
        run_sft(cfg, out_dir=str(out), progress=view.warm_start_progress)
    return str(out)


def discard_versions_after(store, version: int) -> list[int]:
    """Delete weight versions newer than ``version`` (published after the checkpoint a run resumes
    from; the resumed trainer publishes those numbers again). Manifest first, so that a reader never
    sees a version whose files are going away. Returns the deleted versions.

    Needs ``WeightStore`` internals (its fsspec filesystem and version folder names) until the store
    offers a public way to do it.
    """
    newer = [v for v in store.versions() if v > version]
    for v in newer:
        folder = store._dir(v)  # noqa: SLF001 - see the docstring
        store._fs.rm_file(f"{folder}/manifest.json")  # noqa: SLF001
        store._fs.rm(folder, recursive=True)  # noqa: SLF001
    return newer


def load_policy(cfg: RunConfig, init_path: str | None, vocab_size: int) -> torch.nn.Module:
    """The policy at ``init_path`` (HF folder), or a fresh model of ``cfg.model`` seeded by the torch RNG."""
    if init_path is None:
        return build_model(cfg.model, vocab_size)
    return from_pretrained(init_path, dtype=_DTYPES[cfg.model.dtype], device=cfg.model.device)


def make_engine(model: torch.nn.Module, cfg: RunConfig, *, version: int = 0) -> Engine:
    """A rollout engine sized by ``cfg.rollout`` (slots, KV budget, prefill cap, sync period), seeded by ``cfg.seed``."""
    return Engine.from_config(model, cfg.rollout, seed=cfg.seed, version=version)


def make_queue(cfg: RunConfig, task, tokenizer) -> TaskQueue:
    """The task queue over the task's endless, seeded training prompts (one task = one group)."""
    return TaskQueue(
        task.train_prompts(cfg.task.seed + cfg.seed),
        num_samples=cfg.rollout.group_size,
        tokenize=tokenizer.encode,
        max_materialized=cfg.runtime.max_materialized_tasks,
    )


def make_buffer(cfg: RunConfig, queue, *, version: int = 0) -> ExperienceBuffer:
    """The experience buffer: capacity, staleness rule (0 in sync mode), DAPO filter, queue settlement."""
    from moerl.rl import preset_from_config

    filters = (has_reward_variance,) if preset_from_config(cfg.algorithm).dynamic_sampling else ()
    max_staleness = 0 if cfg.runtime.mode == "sync" else cfg.runtime.max_staleness
    return ExperienceBuffer(
        max(cfg.runtime.buffer_groups, cfg.trainer.batch_groups),
        max_staleness=max_staleness,
        stale_policy=cfg.runtime.stale_policy,
        filters=filters,
        settle=queue.settle,
        requeue=queue.requeue,
        initial_version=version,
    )


def make_worker(
    cfg: RunConfig, worker_id: str, model, task, tokenizer, queue, buffer, weights, *, version: int = 0
) -> RolloutWorker:
    """A rollout worker with its own engine over ``model`` (an ``EpisodeWorker`` for ``task.name: env``)."""
    if cfg.task.name == "env":
        engine = make_engine(model, cfg, version=version)
        return episode_worker(cfg, worker_id, engine, task, tokenizer, queue, buffer, weights)
    return RolloutWorker(
        worker_id,
        make_engine(model, cfg, version=version),
        task,
        tokenizer.decode,
        queue,
        buffer,
        cfg.rollout,
        stop_token_ids=(tokenizer.eos_id,),
        weights=weights,
        run_seed=cfg.seed,
        lease_ttl_s=cfg.runtime.lease_ttl_s,
    )


@dataclass(frozen=True, slots=True)
class FleetState:
    """What the fleet holds at the end of a run (for the exactly-once accounting)."""

    queue: QueueStats
    """Queue counters."""
    buffer: BufferMetrics
    """Buffer counters."""
    queued_task_ids: tuple[str, ...]
    """Tasks pending or leased in the queue."""
    buffered_task_ids: tuple[str, ...]
    """Tasks whose groups are still in the buffer."""
    reward_errors: int
    """Samples whose reward function raised, over all workers."""

    @classmethod
    def from_states(
        cls,
        queue: QueueStats,
        buffer: BufferMetrics,
        queue_state: dict,
        buffer_state: dict,
        reward_errors: int,
    ) -> FleetState:
        """Build it from the counters and the ``state_dict()`` of ``TaskQueue`` and ``ExperienceBuffer``."""
        return cls(
            queue=queue,
            buffer=buffer,
            queued_task_ids=tuple(t["task_id"] for t in queue_state["tasks"]),
            buffered_task_ids=tuple(g["task"]["task_id"] for g in buffer_state["groups"]),
            reward_errors=reward_errors,
        )


@dataclass
class Components:
    """A run's parts in the driver: tokenizer, task, policy and how to start the fleet."""

    cfg: RunConfig
    """The run config."""
    init_path: str | None
    """HF folder the policy was loaded from (None: fresh model)."""
    store: WeightStore
    """The weight store (source of truth for the workers' weights)."""
    tokenizer: Tokenizer
    """The run's tokenizer."""
    task: Task
    """The task (prompts and reward)."""
    model: torch.nn.Module
    """The policy being trained (the trainer's model; eval runs on it)."""

    def start_fleet(self, version: int, parts: dict | None):
        """Start the sync ``LocalFleet`` or the async ``RayFleet`` at ``version`` (restoring ``parts``)."""
        if self.cfg.runtime.mode == "async":
            from moerl.runtime.actors import RayFleet

            return RayFleet(self.cfg, self.init_path, self.store.url, version=version, parts=parts)
        queue = make_queue(self.cfg, self.task, self.tokenizer)
        buffer = make_buffer(self.cfg, queue, version=version)
        weights = LocalWeights()
        weights.push(version, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        worker = make_worker(
            self.cfg,
            "local-0",
            copy.deepcopy(self.model),
            self.task,
            self.tokenizer,
            queue,
            buffer,
            weights,
            version=-1,
        )
        fleet = LocalFleet(queue, buffer, worker, weights)
        if parts is not None:
            fleet.load_state_dict(parts)
        return fleet


def build_components(cfg: RunConfig, init_path: str | None, store) -> Components:
    """Tokenizer, task and policy of a run (the policy seeded by the torch RNG when fresh)."""
    tokenizer = load_tokenizer(tokenizer_path_for(cfg.task.tokenizer, init_path or cfg.model.path))
    task = make_task(cfg.task, cfg.env)
    model = load_policy(cfg, init_path, tokenizer.vocab_size)
    return Components(cfg, init_path, store, tokenizer, task, model)


def evaluate(comp: Components) -> float:
    """Held-out greedy accuracy of the driver's policy (``moerl.tasks.eval.evaluate``)."""
    from moerl.tasks.eval import evaluate as evaluate_task

    r = comp.cfg.rollout
    return evaluate_task(
        comp.model,
        comp.tokenizer,
        comp.task,
        max_new_tokens=r.max_new_tokens,
        max_slots=r.max_slots,
        kv_token_budget=r.kv_token_budget,
    ).accuracy


def accounting(ledger: list[LedgerEntry], fleet: FleetState) -> dict[str, int]:
    """Exactly-once task accounting from the ledger and the queue/buffer contents.

    Every task drawn from the data source (the queue's cursor) must end in exactly one place:
    trained (ledger), still in the buffer, still pending/leased in the queue, filtered, or dropped
    as stale. ``tasks_duplicated`` counts ledger ids trained more than once plus trained ids that are
    also still queued or buffered; ``tasks_lost`` counts drawn tasks that are in none of the places.
    """
    counts = Counter(e.task_id for e in ledger)
    trained = set(counts)
    waiting = set(fleet.queued_task_ids) | set(fleet.buffered_task_ids)
    duplicated = sum(c - 1 for c in counts.values()) + len(trained & waiting)
    accounted = len(trained | waiting) + fleet.queue.filtered + fleet.buffer.dropped_stale
    return {
        "tasks_drawn": fleet.queue.cursor,
        "tasks_leased": fleet.queue.leased,
        "tasks_acked": fleet.queue.acked,
        "tasks_requeued": fleet.queue.requeued,
        "tasks_trained": len(ledger),
        "tasks_filtered": fleet.queue.filtered,
        "tasks_dropped_stale": fleet.buffer.dropped_stale,
        "tasks_waiting": len(waiting),
        "tasks_duplicated": duplicated,
        "tasks_lost": fleet.queue.cursor - accounted,
    }
