"""Where each part of a run runs and what it holds: one ``Placement``, built once from the run config.

    Placement.from_config(cfg)
      driver     Run, the trainer's driver side; holds the policy? evaluates version 0? probes precision?
      trainer    one process in the driver, or a group of ranks (local processes or Ray actors)
      rollout    in the driver (sync) or Ray actors (async); EP group size; cache kind; engine weights;
                 the weight transport; the staleness the buffer admits
      reward     learned reward scoring: in the driver's process (sync) or Ray reward workers (async)
      env        environment workers of multi-turn tasks: threads of the worker or Ray actors
      exchange   task queue + experience buffer: in the driver (sync) or one Ray actor (async)

This module is the one reader of ``runtime.mode``, ``trainer.num_ranks``, ``rollout.kv_cache`` and
``rollout.weight_dtype`` for those decisions: the run (``moerl.train``), the builders
(``moerl.runtime.build``, ``moerl.trainer.distributed.factory``), the rollout sides and the load-time
memory check consult the placement instead. It is pure (no Ray, no torch), so every process of a run (a
Ray actor builds its worker from the config it was sent) derives the same answers with
``Placement.from_config``; torchtitan's ``config/configurable.py`` (the config builds the part it
configures) and slime's ``ray/placement_group.py`` are the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config sits on this layer; only its types are needed
    from moerl.config import RunConfig

IN_DRIVER = "driver"
"""A part that runs in the driver's process (``moerl train``)."""
LOCAL_PROCESSES = "local_processes"
"""A part whose ranks are processes the driver starts on its host (``multiprocessing`` spawn, no Ray)."""
RAY_ACTORS = "ray_actors"
"""A part that runs as Ray actors (a local Ray instance or ``runtime.ray_address``)."""
THREADS = "threads"
"""A part that runs on threads of the process that uses it."""

IN_PROCESS_TRANSPORT = "in_process"
"""The weight transport of a rollout side in the driver: tensors handed over by reference
(``moerl.weights.sources.LocalWeights``), whatever ``runtime.weight_sync`` says."""


@dataclass(frozen=True, slots=True)
class DriverPlacement:
    """What the driver process (``moerl train``: ``Run``, the trainer's driver side) holds and does."""

    holds_policy: bool
    """The driver keeps a copy of the policy: the one-process trainer's model, or the copy sync mode
    evaluates. False in async mode with a trainer group (its ranks hold the shards, a worker evaluates)."""
    evaluates_start: bool
    """The driver evaluates version 0 itself, on its copy (a transient eval engine): sync mode, and async
    mode with a one-process trainer while the workers start. False with a trainer group (no copy) or FP8
    rollout weights (a worker evaluates the weights it samples from, once it is up)."""
    evaluates_later: bool
    """The driver evaluates every later version in process (sync mode); False: a rollout worker does
    (``Rollouts.evaluate`` on a worker)."""
    probes_precision: bool
    """The step measures the rollout engine's lower-precision copy against the trainer's policy
    (``moerl.rollout.precision_gap``): FP8 engine weights, the engine and the one-process trainer both in
    the driver."""


@dataclass(frozen=True, slots=True)
class TrainerPlacement:
    """Where the trainer's ranks run."""

    num_ranks: int
    """Training processes (``trainer.num_ranks``): 1 is the one-process trainer in the driver."""
    ranks_run_on: str
    """``IN_DRIVER`` (one rank), ``LOCAL_PROCESSES`` (a group, sync mode) or ``RAY_ACTORS`` (a group, async
    mode: started on the run's Ray instance, which must be up first)."""

    @property
    def is_group(self) -> bool:
        """More than one rank: a ``TrainerGroup`` driven as one trainer."""
        return self.num_ranks > 1

    @property
    def needs_ray_first(self) -> bool:
        """The trainer's ranks are Ray actors: the run starts Ray before it builds the trainer."""
        return self.ranks_run_on == RAY_ACTORS


@dataclass(frozen=True, slots=True)
class RolloutPlacement:
    """Where the rollout workers run and what their engines hold."""

    runs_on: str
    """``IN_DRIVER`` (sync: one worker in the driver's process) or ``RAY_ACTORS`` (async)."""
    num_workers: int
    """Rollout workers (one in the driver in sync mode, ``rollout.num_workers`` actors in async mode)."""
    ep_size: int
    """Ranks of one worker's EP group (``rollout.ep_size``; 1: no EP group)."""
    cache_kind: str
    """The engine's KV cache (``rollout.kv_cache``): ``paged`` or ``slots``."""
    weight_dtype: str
    """The engine's copy of the policy (``rollout.weight_dtype``: ``auto``, ``bf16`` or ``fp8``)."""
    weight_transport: str
    """How a version reaches the workers: ``IN_PROCESS_TRANSPORT`` in the driver, else the name of a
    ``moerl.weights.transport.TRANSPORTS`` entry (``runtime.weight_sync``)."""
    max_staleness: int
    """Versions a group may lag the trainer and still be admitted: 0 in sync mode (on-policy), else
    ``runtime.max_staleness``."""

    @property
    def is_in_driver(self) -> bool:
        """The one rollout worker runs in the driver's process (sync mode: generate-then-train)."""
        return self.runs_on == IN_DRIVER

    @property
    def is_fp8(self) -> bool:
        """The engines sample from FP8 weights (``fp8/*`` metrics are reported)."""
        return self.weight_dtype == "fp8"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each part of one run runs and what it holds (module docstring); build with ``from_config``."""

    run_mode: str
    """``sync`` or ``async`` (``runtime.mode``), as ``summary.json`` ``mode`` reports it."""
    ray_address: str | None
    """The Ray cluster the run joins (checked before the warm start); None: a local instance or no Ray."""
    driver: DriverPlacement
    trainer: TrainerPlacement
    rollout: RolloutPlacement
    reward_runs_on: str
    """Learned reward scoring (``reward.model_path``): ``IN_DRIVER`` (sync: ``ScoringSink``) or
    ``RAY_ACTORS`` (async: ``reward.num_workers`` reward workers); meaningful only with a reward model."""
    env_runs_on: str
    """Environment workers of ``task.name: env``: ``THREADS`` of the worker's process (sync) or
    ``RAY_ACTORS`` (async, ``moerl.envs.pool_ray``)."""
    exchange_runs_on: str
    """Task queue + experience buffer: ``IN_DRIVER`` (sync) or one Ray actor (async, ``ExchangeActor``)."""

    @property
    def uses_ray(self) -> bool:
        """Some part of the run is a Ray actor: Ray must import here (checked before the warm start)."""
        return RAY_ACTORS in (self.rollout.runs_on, self.trainer.ranks_run_on, self.exchange_runs_on)

    @property
    def starts_local_ray(self) -> bool:
        """The run starts its own Ray instance on this host (no ``runtime.ray_address``)."""
        return self.uses_ray and not self.ray_address

    @property
    def starts_rollouts_early(self) -> bool:
        """A fresh run starts its rollout workers before its trainer is built and builds it meanwhile:
        Ray workers next to a one-process trainer, whose version 0 is the warm start's folder that the
        workers load themselves. A trainer group starts on the same Ray instance first."""
        return self.rollout.runs_on == RAY_ACTORS and not self.trainer.is_group

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Placement:
        """The placement of the run ``cfg`` (already validated by ``RunConfig``). Pure: no Ray, no devices."""
        return cls._build(cfg, is_async=cfg.runtime.mode == "async", num_ranks=cfg.trainer.num_ranks)

    @classmethod
    def single_process(cls, cfg: RunConfig) -> Placement:
        """Everything in the driver's one process, whatever ``runtime.mode`` and ``trainer.num_ranks`` say:
        what ``moerl generate`` builds (one engine over one copy of the model, no Ray)."""
        return cls._build(cfg, is_async=False, num_ranks=1)

    @classmethod
    def _build(cls, cfg: RunConfig, *, is_async: bool, num_ranks: int) -> Placement:
        is_fp8 = cfg.rollout.weight_dtype == "fp8"
        in_driver = not is_async
        driver = DriverPlacement(
            holds_policy=in_driver or num_ranks == 1,
            evaluates_start=in_driver or (num_ranks == 1 and not is_fp8),
            evaluates_later=in_driver,
            probes_precision=in_driver and is_fp8 and num_ranks == 1,
        )
        if num_ranks == 1:
            ranks_run_on = IN_DRIVER
        else:
            ranks_run_on = RAY_ACTORS if is_async else LOCAL_PROCESSES
        outside = RAY_ACTORS if is_async else IN_DRIVER
        rollout = RolloutPlacement(
            runs_on=outside,
            num_workers=cfg.rollout.num_workers if is_async else 1,
            ep_size=cfg.rollout.ep_size,
            cache_kind=cfg.rollout.kv_cache,
            weight_dtype=cfg.rollout.weight_dtype,
            weight_transport=cfg.runtime.weight_sync if is_async else IN_PROCESS_TRANSPORT,
            max_staleness=cfg.runtime.max_staleness if is_async else 0,
        )
        return cls(
            run_mode="async" if is_async else "sync",
            ray_address=cfg.runtime.ray_address if is_async else None,
            driver=driver,
            trainer=TrainerPlacement(num_ranks, ranks_run_on),
            rollout=rollout,
            reward_runs_on=outside,
            env_runs_on=RAY_ACTORS if is_async else THREADS,
            exchange_runs_on=outside,
        )
