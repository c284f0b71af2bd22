"""Building a run's parts from its config: policy, engine, task queue, experience buffer, rollout worker.

Used by the driver (``moerl.train``, ``LocalRollouts``) and by the Ray actors, which build their own
worker, queue and buffer from the same config in their own process (``moerl.runtime.ray``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moerl.config import RunConfig
from moerl.models import build_model, from_pretrained
from moerl.models.dtypes import torch_dtype
from moerl.models.mtp import attach_fresh_mtp
from moerl.placement import Placement
from moerl.rollout import Engine
from moerl.rollout.weight_dtype import prepare_rollout_model
from moerl.runtime.data_plane import make_buffer, make_queue  # noqa: F401 - re-exported
from moerl.runtime.delivery import GroupSink
from moerl.runtime.episode_worker import episode_worker
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Task, Tokenizer, make_task
from moerl.tasks.eval import EvalResult, evaluate
from moerl.tasks.tokenizer import load_run_tokenizer
from moerl.weights.sources import WeightSource
from moerl.weights.store import WeightStore


def load_policy(cfg: RunConfig, init_path: str | None, vocab_size: int) -> torch.nn.Module:
    """The policy at ``init_path`` (HF folder), or a fresh model of ``cfg.model`` seeded by the torch RNG.
    A run that trains or drafts with an MTP module (``trainer.mtp_loss_weight > 0``,
    ``rollout.speculative=mtp``) gives a policy without one a fresh one (``attach_fresh_mtp``, no RNG
    drawn), so every process's copy has the same tensors."""
    if init_path is None:
        model = build_model(cfg.model, vocab_size)
    else:
        model = from_pretrained(init_path, dtype=torch_dtype(cfg.model.dtype), device=cfg.model.device)
    if cfg.trainer.mtp_loss_weight > 0 or cfg.rollout.speculative == "mtp":
        attach_fresh_mtp(model)
    return model


def make_engine(model: torch.nn.Module, cfg: RunConfig, *, version: int = 0) -> Engine:
    """A rollout engine sized by ``cfg.rollout`` (KV cache kind and budget, sequences decoding together,
    prefill cap, sync period), seeded by ``cfg.seed``, over the cache policy the placement names
    (``Placement.rollout.cache_kind``: paged blocks by default, or slots). The engine's weights take the
    placement's rollout weight dtype (``model``, the engine's own copy, is converted in place:
    ``moerl.rollout.weight_dtype.prepare_rollout_model``)."""
    placed = Placement.from_config(cfg).rollout
    model = prepare_rollout_model(model, placed.weight_dtype)
    return Engine.from_config(model, cfg.rollout, cache=placed.cache_kind, seed=cfg.seed, version=version)


def make_worker(
    cfg: RunConfig,
    worker_id: str,
    model: torch.nn.Module,
    task: Task,
    tokenizer: Tokenizer,
    queue,
    buffer: GroupSink,
    weights: WeightSource,
    *,
    version: int = 0,
    pause_point: Callable[[], None] | None = None,
    engine=None,
) -> RolloutWorker:
    """A rollout worker with its own engine over ``model``; ``queue`` is a ``TaskQueue`` or its proxy;
    ``pause_point``: see ``RolloutWorker``. For ``task.name: env`` an ``EpisodeWorker`` (``moerl.envs``).
    ``engine``: an engine built already (an EP group's ``EPGroupEngine``); None: one over ``model``."""
    if engine is None:
        engine = make_engine(model, cfg, version=version)
    if cfg.task.name == "env":
        return episode_worker(
            cfg, worker_id, engine, task, tokenizer, queue, buffer, weights, pause_point=pause_point
        )
    return RolloutWorker.from_run_config(
        cfg, worker_id, engine, task, tokenizer, queue, buffer, weights, pause_point=pause_point
    )


@dataclass
class Components:
    """A run's parts in the driver: tokenizer, task and the policy being trained."""

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
    model: torch.nn.Module | None
    """The driver's policy: the one-process trainer's model, and what sync mode evaluates. None when
    the driver holds no copy (async mode with a trainer group and a ``init_path``: the ranks load their
    shards from it, a rollout worker evaluates: ``moerl.placement.DriverPlacement.holds_policy``)."""

    def evaluate(self, prompts: list | None = None) -> EvalResult:
        """Held-out greedy evaluation of the driver's policy (``moerl.tasks.eval.evaluate``) on ``prompts``
        (default: the task's main held-out set): its exact match (``accuracy``, in [0, 1]) or, for a task
        with no notion of correctness, its mean reward (``metric``); with ``eval.k`` also the sampled pass@k.

        Raises:
            RuntimeError: the driver holds no copy of the policy (``model`` is None).
        """
        if self.model is None:
            raise RuntimeError("the driver holds no copy of the policy: evaluate on a rollout worker")
        r = self.cfg.rollout
        return evaluate(
            self.model,
            self.tokenizer,
            self.task,
            prompts,
            max_new_tokens=r.max_new_tokens,
            max_slots=r.max_slots,
            kv_token_budget=r.kv_token_budget,
            sampling=self.cfg.eval,
        )


def build_components(cfg: RunConfig, init_path: str | None, store: WeightStore) -> Components:
    """Tokenizer, task and policy of a run (the policy seeded by the torch RNG when fresh). No policy
    (``model`` None) when the driver needs none (``Placement.driver.holds_policy``) and ``init_path`` gives the
    trainer ranks their weights; a fresh policy is still built, to be saved for the ranks (the run
    drops it once the trainer has started)."""
    tokenizer = load_run_tokenizer(cfg, init_path)
    task = make_task(cfg.task, cfg.env, tokenizer)
    if init_path is not None and not Placement.from_config(cfg).driver.holds_policy:
        return Components(cfg, init_path, store, tokenizer, task, None)
    model = load_policy(cfg, init_path, tokenizer.vocab_size)
    return Components(cfg, init_path, store, tokenizer, task, model)
