"""Sync mode's rollout side: queue, buffer and one ``RolloutWorker`` in this process, no Ray.

Generate-then-train: ``next_groups(n)`` has the worker generate exactly ``n`` groups at the current
weights and takes them from the buffer (``max_staleness`` 0: on-policy). Implements ``Rollouts``
(``moerl.runtime.rollouts``), as ``moerl.runtime.ray.RayRollouts`` does for async mode.

The worker switches only to versions equal to its engine's parameter set (``CheckedWeights``, as in async
mode). Sync mode generates on-policy, so a refused version cannot be trained around: ``next_groups``
raises ``WeightVersionRefused`` (the ``moerl`` command prints it as one line and exits 1).

``rollout.ep_size > 1`` is refused for sync mode when the config loads (``ConfigError``): an EP rollout
worker is a group of processes (``moerl.runtime.ray.ep_group``), and this side runs one in-process engine.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from moerl.config import RunConfig
from moerl.errors import WeightVersionRefused
from moerl.placement import Placement
from moerl.records import Group, RolloutTask
from moerl.rollout.precision_gap import LogprobGap, logprob_gap
from moerl.runtime.accounting import FleetState
from moerl.runtime.buffer import BufferMetrics, ExperienceBuffer
from moerl.runtime.build import Components, make_buffer, make_queue, make_worker
from moerl.runtime.fleet import WorkerHealth, WorkerRecord, WorkerState
from moerl.runtime.queue import QueueStats, TaskQueue
from moerl.runtime.reward import LocalRewardScorer, ScoringSink
from moerl.runtime.worker import RolloutWorker, WorkerStats
from moerl.tasks.eval import EvalResult
from moerl.trainer.protocol import Trainer
from moerl.weights.sources import CheckedWeights, LocalWeights, parameter_set, refused_versions_of
from moerl.weights.store import WeightStore
from moerl.weights.transport import WeightHolder
from moerl.weights.transports import ensure_durable, write_durable

_NEVER = ("fleet/interruptions", "fleet/drained", "fleet/killed", "fleet/lost_work_frac")


class LocalRollouts:
    """The in-process rollout side (module docstring).

    Args:
        queue: the task queue.
        buffer: the experience buffer over ``queue``.
        worker: the one rollout worker, polling ``weights``.
        weights: where ``publish`` hands the trainer's weights over (in process; a ``LocalWeights``,
            or a ``CheckedWeights`` over one).
        store: the run's weight store, written in the background at ``publish`` every ``durable_every``
            versions, at a checkpoint's and at the last one (None: not written from here).
        scorer: the reward model scoring the worker's deliveries (``reward.model_path``), or None.
        durable_every: ``runtime.durable_every``; 1: every version is written to the store.
        evaluator: the held-out evaluation of the driver's copy of the policy (``Components.evaluate``:
            prompts or None -> ``EvalResult``); None: ``evaluate`` raises.
        probes_precision: ``precision_gap`` measures the engine's copy against the trainer's policy
            (``Placement.driver.probes_precision``).
    """

    def __init__(
        self,
        queue: TaskQueue,
        buffer: ExperienceBuffer,
        worker: RolloutWorker,
        weights: LocalWeights | CheckedWeights,
        store: WeightStore | None = None,
        *,
        scorer: LocalRewardScorer | None = None,
        durable_every: int = 1,
        evaluator: Callable[[list | None], EvalResult] | None = None,
        probes_precision: bool = False,
    ) -> None:
        if durable_every < 1:
            raise ValueError(f"durable_every={durable_every} must be at least 1")
        self.queue, self.buffer, self.worker, self.weights = queue, buffer, worker, weights
        self.store, self.durable_every = store, durable_every
        self.scorer = scorer
        self.evaluator, self.probes_precision = evaluator, probes_precision
        self._publish_s: float | None = None  # the last publish's store write (when due) + hand-over

    @classmethod
    def start(cls, cfg: RunConfig, comp: Components, version: int, parts: dict | None) -> LocalRollouts:
        """Build queue, buffer and worker for a run at policy ``version`` (restoring checkpoint ``parts``).

        The worker generates with its own copy of the policy; its engine loads ``version`` on its first
        poll.
        """
        queue = make_queue(cfg, comp.task, comp.tokenizer)
        buffer = make_buffer(cfg, queue, version=version)
        model = copy.deepcopy(comp.model)
        weights = CheckedWeights(LocalWeights(), parameter_set(model))
        weights.push(version, {k: v.detach().clone() for k, v in comp.model.state_dict().items()})
        scorer, sink = None, buffer
        if cfg.reward.is_enabled:  # the reward model scores each delivery in this process
            scorer = LocalRewardScorer.from_config(cfg.reward, cfg.model.device)
            sink = ScoringSink(buffer, scorer, cfg.reward)
        worker = make_worker(
            cfg, "local-0", model, comp.task, comp.tokenizer, queue, sink, weights, version=-1
        )
        rollouts = cls(
            queue,
            buffer,
            worker,
            weights,
            comp.store,
            scorer=scorer,
            durable_every=cfg.runtime.durable_every,
            evaluator=comp.evaluate,
            probes_precision=Placement.from_config(cfg).driver.probes_precision,
        )
        if parts is not None:
            rollouts.load_state_dict(parts)
        return rollouts

    def next_groups(self, n: int) -> tuple[list[Group], float, float]:
        """Generate ``n`` groups and take them from the buffer.

        Returns:
            ``(groups, generation seconds, wait seconds)``; the wait is 0 in sync mode.
        """
        start = time.perf_counter()
        self._check_not_refused()
        while self.buffer.metrics().depth < n:
            self.worker.run(num_groups=n - self.buffer.metrics().depth)
        gen_s = time.perf_counter() - start
        return self.buffer.get(n, timeout=0), gen_s, 0.0

    def _check_not_refused(self) -> None:
        """Raises ``WeightVersionRefused`` when the worker refused the version last pushed (after trying
        to load it): generating on at an older version would not be on-policy."""
        self.worker.sync_weights()
        if self.worker.version < self.weights.version and refused_versions_of(self.weights):
            raise WeightVersionRefused(
                f"the rollout worker refused weight version {self.weights.version} (its tensors are not the "
                f"engine's parameter set; see the log); sync mode generates on-policy only"
            )

    def publish(
        self,
        trainer: WeightHolder,
        *,
        is_stored: bool = False,
        is_final: bool = False,
        is_durable: bool = False,
    ) -> None:
        """The in-process weight hand-off of sync mode: hand the trainer's tensors to the worker
        (``LocalWeights``: references, no bytes; the engine copies them tensor to tensor on its device at
        its next poll, ``Engine.update_weights``) and advance the staleness clock. A version that is a
        multiple of ``durable_every``, ``is_final`` or ``is_durable`` (a checkpoint's) also goes to the
        store, unless ``is_stored`` (the caller wrote it): off the critical path (``write_durable``: a
        host snapshot now, the write on the store's writer thread).

        Raises:
            WeightWriteError: an earlier background write failed (the run stops with one line).
        """
        t0 = time.perf_counter()
        version = trainer.version
        is_due = is_final or is_durable or version % self.durable_every == 0
        if self.store is not None:
            self.store.check_writes()
            if not is_stored and is_due:
                write_durable(self.store, trainer)
        self.weights.push(version, trainer.named_weights())
        self.buffer.set_version(version)
        self._publish_s = time.perf_counter() - t0

    def start_milestones(self) -> dict[str, float]:
        """``Rollouts.start_milestones``: none in process."""
        return {}

    def published_version(self) -> int:
        """``Rollouts.published_version``: the version last handed to the worker."""
        return self.weights.version

    def evaluate(self, trainer: Trainer, prompts: list | None) -> EvalResult:
        """``Rollouts.evaluate`` in process: the driver's copy of the policy brought to ``trainer``'s
        version (``refresh_model``; the one-process trainer's model is that copy), then evaluated.

        Raises:
            RuntimeError: built without an ``evaluator`` (no driver copy).
        """
        if self.evaluator is None:
            raise RuntimeError("LocalRollouts.evaluate: no evaluator of the driver's copy was given")
        trainer.refresh_model()  # a streamed version reaches the driver's copy only when needed
        return self.evaluator(prompts)

    def precision_gap(self, trainer: Trainer, groups: list[Group]) -> LogprobGap | None:
        """``Rollouts.precision_gap``: the engine's copy against ``trainer.model`` on ``groups``' samples
        when ``probes_precision``, else None."""
        if not self.probes_precision:
            return None
        seqs = [(s.prompt_ids, s.response_ids) for g in groups for s in g.samples]
        was_training = trainer.model.training
        try:
            trainer.model.eval()
            return logprob_gap(trainer.model, self.engine_model(), seqs)
        finally:
            trainer.model.train(was_training)

    def make_durable(self, trainer: WeightHolder) -> None:
        """``Rollouts.make_durable``: the trainer's version in the store (``ensure_durable``); nothing
        without a store."""
        if self.store is not None:
            ensure_durable(self.store, trainer)

    def requeue(self, task: RolloutTask) -> None:
        """Hand a trained task back to the queue (its training was lost with a trainer restart)."""
        self.queue.requeue(task)

    def queue_stats(self) -> QueueStats:
        """``TaskQueue.stats()``."""
        return self.queue.stats()

    def buffer_metrics(self) -> BufferMetrics:
        """``ExperienceBuffer.metrics()``."""
        return self.buffer.metrics()

    def engine_model(self) -> torch.nn.Module:
        """The in-process engine's model (its own copy of the policy, in ``rollout.weight_dtype``)."""
        return self.worker.engine.model

    def worker_stats(self) -> list[WorkerStats]:
        """Counters of every worker."""
        return [self.worker.stats]

    def fleet_values(self, batch_groups: int) -> dict[str, float]:
        """The step's ``fleet/*`` metrics (one in-process worker, never interrupted), the versions it refused
        (``weights/refused_total``), the weight hand-off's seconds (``timing/weight_sync_s`` the last
        ``publish``: store write when due + hand-over; ``timing/weight_sync_worker_s`` the engine's copy of
        the version it last loaded, None before) and, with a reward model, its ``reward/*`` metrics since
        the previous step."""
        load_s = self.worker.stats.last_weight_load_s if self.worker.stats.weight_updates else None
        values = {
            **dict.fromkeys(_NEVER, 0),
            "fleet/workers_alive": 1,
            "fleet/desired_workers": 1,
            "weights/refused_total": refused_versions_of(self.weights),
            "timing/weight_sync_s": self._publish_s,
            "timing/weight_sync_worker_s": load_s,
            "rollout/tokens_resumed": self.worker.stats.tokens_resumed,
            "rollout/tokens_discarded": self.worker.stats.tokens_discarded,
        }
        if self.scorer is not None:
            values.update(self.scorer.stats.take())
        return values

    def worker_records(self) -> list[WorkerRecord]:
        """A record of the in-process worker (always alive), as ``RayRollouts`` reports its workers."""
        stats = self.worker.stats
        health = WorkerHealth(
            tokens_delivered=stats.tokens_generated,
            groups_delivered=stats.groups_put,
            policy_version=self.worker.version,
            tokens_resumed=stats.tokens_resumed,
            tokens_discarded=stats.tokens_discarded,
        )
        return [WorkerRecord(self.worker.worker_id, 0.0, WorkerState.ALIVE, health=health)]

    def policy_lags(self) -> dict[str, int]:
        """The in-process worker's lag: the version last pushed minus its engine's (read between steps,
        so exact; absent before its first load)."""
        if self.worker.version < 0:
            return {}
        return {self.worker.worker_id: max(self.weights.version - self.worker.version, 0)}

    def fleet_summary(self) -> dict:
        """Fleet figures for ``summary.json`` (nothing to report in-process)."""
        return {}

    def state_dict(self) -> dict:
        """Queue and buffer state (the worker is idle between sync steps)."""
        return {"queue": self.queue.state_dict(), "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict`` into the fresh queue and buffer."""
        self.queue.load_state_dict(state["queue"])
        self.buffer.load_state_dict(state["buffer"])

    def final_state(self) -> FleetState:
        """``FleetState`` for the run's accounting."""
        return FleetState.from_states(
            self.queue.stats(),
            self.buffer.metrics(),
            self.queue.state_dict(),
            self.buffer.state_dict(),
            self.worker.stats.reward_errors,
        )

    def close(self) -> None:
        """Nothing to stop in-process."""
