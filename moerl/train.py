"""The main job: one RL run (GRPO and variants) from warm start to summary, as a ``Run`` object.

    start:   weight store -> warm start (SFT unless init_from) -> policy + trainer -> version 0
             published and evaluated (or a checkpoint restored) -> rollouts started. A fresh async run
             with a one-process trainer starts the rollout workers first and builds the trainer and
             evaluates version 0 meanwhile (``Placement.starts_rollouts_early``); with a trainer group (no policy
             copy in the driver) or FP8 rollout weights a worker evaluates version 0 once it is up
    step:    lease -> generate -> score -> buffer (inside ``Rollouts.next_groups``) -> train ->
             publish -> eval -> log -> checkpoint
    recover: a trainer killed by chaos restarts from the newest checkpoint while the rollouts go on
    finish:  stop the rollouts, exactly-once accounting, export the policy, summary.json

The rollout side is ``LocalRollouts`` (sync: one process, no Ray, generate-then-train, on-policy) or
``RayRollouts`` (async: rollout workers as Ray actors generating while the trainer trains). Both
implement ``moerl.runtime.rollouts.Rollouts``; everything else is shared. ``train`` and ``resume`` are the
entry points (``moerl train``); Ctrl-C or SIGTERM ends a run with ``RunInterrupted``.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from moerl.allocator import keep_freed_memory
from moerl.config import ConfigError, RunConfig
from moerl.envs.stats import merge as env_merge
from moerl.envs.stats import step_values as env_step_values
from moerl.errors import EvalVersionRefused, RewardFunctionError
from moerl.placement import Placement
from moerl.records import Group
from moerl.rollout.precision_gap import LogprobGap
from moerl.run.group_recovery import restart_group
from moerl.run.interrupt import RunInterrupted, sigterm_interrupts, stops_on_full_disk, stops_on_lost_exchange
from moerl.run.preflight import check_run_inputs
from moerl.run.recovery import StepJournal, recover_trainer
from moerl.run.resume import check_init_from, removed_on_failure, resume_checkpoint, resumed_config
from moerl.run.reward_errors import RewardErrorWatch
from moerl.run.warm_start import fine_tunes, warm_start
from moerl.rundir.folder import LedgerEntry, RunDir, RunFolderLock, check_resumable, read_jsonl
from moerl.rundir.storage import RunMirror, fetch_for_resume, is_remote, use_local_storage
from moerl.runtime.accounting import FleetState, accounting
from moerl.runtime.build import Components, build_components
from moerl.runtime.chaos import ChaosMonkey
from moerl.runtime.ray import check_ray_address, init_ray, stops_ray_it_started
from moerl.runtime.rollouts import Rollouts
from moerl.runtime.start import RolloutsStart, start_rollouts
from moerl.runtime.worker import WorkerStats
from moerl.tasks.eval import (
    EXACT_MATCH,
    METRIC_NAMES,
    EvalResult,
    eval_keys,
    eval_values,
    evaluate_sets,
    sample_records,
)
from moerl.tasks.sft import save_tokenizer_and_companions
from moerl.telemetry.live import LiveView, done_line
from moerl.telemetry.report import plot_report
from moerl.telemetry.run import RunTelemetry
from moerl.telemetry.step import StepTimings, fp8_values, kv_values, step_values
from moerl.trainer.checkpoint import latest_checkpoint, load_checkpoint, restore_rng_state
from moerl.trainer.distributed.factory import (
    check_trainer_resources,
    load_trainer_state,
    make_trainer,
    record_ranks,
    trainer_summary,
)
from moerl.trainer.distributed.rank import TrainerRankError
from moerl.trainer.local import NonFiniteLossError, TrainStats
from moerl.trainer.protocol import Trainer
from moerl.weights.store import StoreNotWritableError, WeightStore
from moerl.weights.transports import write_durable


class Run:
    """One RL run in its folder: ``start`` builds it, ``step`` is one loop iteration, ``recover``
    replaces a killed trainer, ``finish`` writes the summary (module docstring).

    Args:
        cfg: the run config (not modified).
        run_dir: the run folder (config, metrics, ledger, checkpoints, weights).
        live: show the console status line.
    """

    def __init__(self, cfg: RunConfig, run_dir: RunDir, *, live: bool = True) -> None:
        self.cfg, self.dir = cfg, run_dir
        self.placement = Placement.from_config(cfg)  # where each part runs: the one owner of that question
        self.process_start, self.wall_start = time.perf_counter(), time.time()
        self.view = LiveView(cfg.trainer.steps, enabled=live)
        self.restarts = 0
        self.mirror = _open_mirror(cfg, run_dir)  # storage.url in an object store: copy there
        self.eval_keys: list[str] | None = None  # eval/pass@k, eval/<set>/... (set at the first step)
        self.startup: dict[str, float] = {}
        """Seconds from this object's creation to each start milestone (summary.json ``startup_s``)."""
        self._first_workers: set[str] = set()  # the workers whose groups made up the first batch

    def start(self, checkpoint: Path | None) -> None:
        """Warm start, build policy and trainer, publish version 0 (or restore ``checkpoint``), start
        the rollouts.

        Raises:
            ConfigError: an unwritable or unreachable weight store, an unreachable Ray address, a bad
                ``init_from``, a CUDA device this machine lacks, a bad import path, dataset or prompt length
                (``check_run_inputs``), a taken ``--metrics-port`` (``MetricsPortError``, before anything else).
        """
        # the endpoint first: a taken --metrics-port fails before any training
        self.telemetry = RunTelemetry.start(self.cfg, self.dir.path, self.dir.metrics)
        try:
            self._start(checkpoint)
        except BaseException:
            self.telemetry.close()
            raise

    def _start(self, checkpoint: Path | None) -> None:
        cfg = self.cfg
        if self.telemetry.url:
            self.view.message(f"metrics at {self.telemetry.url}")
        keep_freed_memory()  # no page faults on each step's activations (moerl.allocator)
        _seed_everything(cfg.seed)
        self.store = _open_store(cfg, self.dir, self.mirror)
        check_trainer_resources(cfg)  # before the warm start, like every bad-input check
        check_run_inputs(cfg)  # import paths, dataset, prompt lengths (moerl.run.preflight)
        if self.placement.ray_address:  # before the warm start, not after
            check_ray_address(self.placement.ray_address)
        init_path = warm_start(cfg, self.dir, self.view)
        self.view.phase("starting the trainer and the rollouts")  # the console's live line until step 1
        if self.mirror is not None and cfg.init_from is None:  # a resume elsewhere then needs no SFT again
            self.mirror.warm_start(Path(init_path))
        # its digests were read when resume_checkpoint picked it (the run folder is locked since)
        parts = load_checkpoint(checkpoint, contents=False) if checkpoint is not None else None
        self.startup["warm_start"] = self._since_start()
        if parts is None and self.placement.starts_rollouts_early:
            self._start_overlapped(init_path)
        else:
            self._build_trainer(init_path)
            try:
                self.state = self._begin(parts, checkpoint)
            except BaseException:
                self.close_trainer()
                raise
            record_ranks(self.trainer, self.dir.path)
            self.rollouts = self._start_rollouts(parts, init_path, self.trainer.version, self.comp)
            self._note_rollouts_started()
        if parts is None and self.state["eval_metric"] is None:  # a rollout worker evaluates v0
            self._start_eval(self._eval_result())
        self.telemetry.watch_fleet(self.rollouts)  # scrapes read the workers' latest heartbeats
        self.telemetry.reload_ledger(e.task_id for e in self.dir.read_ledger())  # resumed: rewound
        self.chaos, self.journal = ChaosMonkey(cfg.chaos), StepJournal()
        if parts is not None:
            restore_rng_state(parts["rng"])
        self.clock0, self.wall0 = time.perf_counter(), self.state["wall_s"]
        self.view.phase(f"generating the first {cfg.trainer.batch_groups} groups")

    def step(self) -> None:
        """One RL step: lease -> generate -> score -> buffer (the rollouts) -> train -> publish -> eval
        -> log -> checkpoint."""
        t0 = time.perf_counter()
        groups, gen_s, wait_s = self.rollouts.next_groups(self.cfg.trainer.batch_groups)
        if "first_groups" not in self.startup:
            self.startup["first_groups"] = self._since_start()
            self._first_workers = {g.worker_id for g in groups}
        fp8_gap = self._fp8_gap(groups)  # before training: the engine and the trainer hold one version
        self.reward_watch.observe(groups)  # a failing reward function stops the run before it trains on zeros
        batch = self.trainer.build_batch(groups, self.comp.tokenizer.pad_id)
        try:
            stats = self.trainer.train_step(batch)
        except TrainerRankError as e:  # a rank died or hung: a new group from the newest checkpoint
            self.restart_group(e, lost=groups)
            return
        if self.trainer.last_ep_traffic is not None:
            for direction, traffic in self.trainer.last_ep_traffic.items():  # EP bytes of all ranks
                self.telemetry.add_ep_traffic(direction, traffic)
        self._record(groups, stats.step)
        if self.chaos.should_kill_trainer(stats.step):  # dies before publishing; the rollouts go on
            self.recover(stats.step)
            return
        try:
            publish_s, final_save_s = self._publish(stats.step)
        except TrainerRankError as e:
            self.restart_group(e)
            return
        t_eval = time.perf_counter()
        accuracy = self._evaluate(stats.step)
        eval_s = time.perf_counter() - t_eval
        timings = StepTimings(
            gen_s=gen_s,
            wait_s=wait_s,
            publish_s=publish_s,
            step_s=time.perf_counter() - t0,
            eval_s=eval_s,
            final_save_s=final_save_s,
        )
        self._log(groups, stats, timings, accuracy, batch.num_sequences, t0, fp8_gap)
        if "first_step" not in self.startup:
            self.startup["first_step"] = self._since_start()
        try:
            self._checkpoint(stats.step)
        except TrainerRankError as e:
            self.restart_group(e)

    def run(self) -> dict:
        """Steps until ``trainer.steps`` (or a non-finite loss), then ``finish``; returns the summary."""
        stop_reason = None
        try:
            while self.trainer.step < self.cfg.trainer.steps:
                self.step()
        except NonFiniteLossError as e:
            stop_reason = str(e)
            self.view.message(f"stopping: {e}")
        except BaseException:
            self.close()
            self.close_trainer()
            raise
        return self.finish(stop_reason)

    def restart_group(self, error: BaseException | str, lost: list[Group] | tuple = ()) -> None:
        """Replace a trainer group whose rank died, hung or failed (``moerl.run.group_recovery``);
        ``lost`` are the groups of a step that did not complete (requeued)."""
        self.view.message(
            f"trainer group failed ({one_line(error)}); restarting it from the newest checkpoint"
        )
        self.trainer, report = restart_group(
            self.cfg,
            self.comp,
            self.dir,
            self.store,
            self.rollouts,
            self.journal,
            self.trainer,
            lost,
            newest_pushed=self.rollouts.published_version(),
        )
        self.restarts += 1
        self.view.message(
            f"trainer group restarted from step {report.restored_step} (failed after step "
            f"{report.failed_step}), {report.tasks_requeued + len(lost)} tasks requeued, weights published "
            f"as v{report.version}"
        )

    def recover(self, failed_step: int) -> None:
        """Replace the trainer that died after ``failed_step`` (``moerl.run.recovery``)."""
        if self.placement.trainer.is_group:  # chaos kill of a group: a new group
            self.restart_group("chaos kill")
            return
        self.store.writer.copies.wait()  # the recovery overwrites the policy's tensors in place
        self.trainer, report = recover_trainer(
            self.cfg,
            self.comp,
            self.dir,
            self.store,
            self.rollouts,
            self.journal,
            failed_step,
            newest_pushed=self.rollouts.published_version(),
        )
        self._fence_weights()  # the new trainer's optimizer
        self.restarts += 1
        self.telemetry.reload_ledger(e.task_id for e in self.dir.read_ledger())  # rewound by the recovery
        self.view.message(
            f"trainer killed after step {failed_step}: restarted from step {report.restored_step}, "
            f"{report.tasks_requeued} tasks requeued, weights published as v{report.version}"
        )

    def finish(self, stop_reason: str | None) -> dict:
        """Stop the rollouts, account for every task, export the policy, write ``summary.json``."""
        fleet_state = self.rollouts.final_state()
        fleet_summary = {**self.rollouts.fleet_summary(), "trainer_restarts": self.restarts}
        is_env = self.cfg.task.name == "env"
        env_summary = env_merge([w.env for w in self.rollouts.worker_stats()]) if is_env else None
        self.close()
        summary = {**self._summary(fleet_state, stop_reason), "fleet": fleet_summary}
        if env_summary is not None:
            summary["env"] = env_summary
        summary.update(trainer_summary(self.trainer))
        summary["policy"] = str(
            export_policy(self.trainer, self.comp.tokenizer, self.dir.path / "policy", self.comp.init_path)
        )
        self.close_trainer()
        summary["process_wall_s"] = time.perf_counter() - self.process_start  # warm start + evals + RL
        if self.mirror is not None:
            summary["storage_url"] = self.mirror.url
        self.dir.write_summary(summary)
        if self.dir.metrics.exists():
            plot_report(self.dir.path)
        if self.mirror is not None:
            self.mirror.finish()
        self.view.message(done_line(summary, self.dir.path, summary.get("storage_url")))  # the one last line
        return summary

    def close(self) -> None:
        """Stop the rollouts and the console view."""
        self.rollouts.close()
        self.view.close()
        self.telemetry.close()  # the endpoint goes away with the run; its port is free afterwards

    def close_trainer(self) -> None:
        """Stop a trainer group's ranks (idempotent; the one-process trainer has none)."""
        if getattr(self, "trainer", None) is not None:
            self.trainer.close()

    # -- the parts of start and step -------------------------------------------------------------

    def _since_start(self) -> float:
        return round(time.perf_counter() - self.process_start, 3)

    def _note_rollouts_started(self) -> None:
        """``startup`` gains ``rollouts_started`` and the rollout side's own milestones
        (``Rollouts.start_milestones``: async ``ray_started``, ``workers_spawned``, ``exchange_ready``)."""
        for name, at in self.rollouts.start_milestones().items():
            self.startup[name] = round(at - self.process_start, 3)
        self.startup["rollouts_started"] = self._since_start()

    def _note_worker_startup(self, workers: list[WorkerStats]) -> None:
        """``startup`` gains the start of the worker whose groups came first (``WorkerStats.startup``), on
        this run's clock: ``worker_init``, ``worker_policy_loaded``, ``worker_ready``, ``worker_first_put``
        (wall clocks of one host; across hosts, as far as their clocks agree). Of the workers that delivered
        the first batch, the one that handed groups over first, from ``workers`` (this step's
        ``Rollouts.worker_stats``); while none of them has answered (a worker lost or unreachable since),
        looked for again at the next step."""
        stamps = [
            w.startup for w in workers if w.worker_id in self._first_workers and w.startup.get("first_put")
        ]
        if stamps:
            first = min(stamps, key=lambda s: s["first_put"])
            self.startup.update({f"worker_{k}": round(v - self.wall_start, 3) for k, v in first.items()})

    def _build_trainer(self, init_path: str | None) -> None:
        """Tokenizer, task, policy (``build_components``) and the trainer (``make_trainer``)."""
        cfg = self.cfg
        self.comp = build_components(cfg, init_path, self.store)
        self.reward_watch = RewardErrorWatch(cfg.task, self.comp.task, self.comp.tokenizer)
        if self.placement.trainer.needs_ray_first:  # the group's rank actors, then the rollout fleet,
            init_ray(cfg)  # on one Ray instance (make_trainer expects it)
        # one rank: a LocalTrainer; more: a TrainerGroup (moerl.trainer.distributed); both a Trainer
        keep = self.placement.driver.holds_policy  # False: a fresh policy is built only to seed the ranks
        self.trainer: Trainer = make_trainer(cfg, self.comp.model, init_path, self.dir.path, keep_copy=keep)
        if not keep:
            self.comp.model = None
        self._fence_weights()
        self.startup["trainer_built"] = self._since_start()

    def _fence_weights(self) -> None:
        """Host copies of the trainer's tensors are taken off the step's path, after the publish returns
        (durable versions: the store's copier thread; ``runtime.overlap_publish``: the send thread): the
        one-process trainer's optimizer waits for them before it changes its tensors in place, so the
        copies overlap generation and the forward and backward passes (a trainer group's ranks hand
        nothing over that way)."""
        optimizer = getattr(self.trainer, "optimizer", None)
        if optimizer is not None:
            copies = self.store.writer.copies
            optimizer.register_step_pre_hook(lambda *_: copies.wait())

    def _start_overlapped(self, init_path: str | None) -> None:
        """A fresh async run with a one-process trainer (``Placement.starts_rollouts_early``): Ray, the exchange and
        the rollout workers start (each loading ``init_path``, version 0) while a thread builds the policy
        and the trainer, evaluates version 0 (before the workers generate beside it on a shared GPU) and
        publishes it. Either side failing stops the other before raising."""

        def build_and_begin() -> None:
            self._build_trainer(init_path)
            self.state = self._begin(None, None)

        with ThreadPoolExecutor(1, thread_name_prefix="moerl-trainer-build") as pool:
            built = pool.submit(build_and_begin)
            try:
                self.rollouts = self._start_rollouts(None, init_path, 0, None)  # comp: being built
                self._note_rollouts_started()
            except BaseException:
                if built.exception() is None:  # waits for the build; its own error is secondary
                    self.close_trainer()
                raise
            try:
                built.result()
            except BaseException:
                self.rollouts.close()
                self.close_trainer()
                raise

    def _begin(self, parts: dict | None, checkpoint: Path | None) -> dict:
        """Fresh: evaluate version 0 and publish it. Resumed: restore the trainer, cut the run folder and
        the weight store back to the checkpoint. Returns the loop's running totals."""
        if parts is None:
            state = {"eval_metric": None, "start_accuracy": None, "start_mean_reward": None}
            state.update(wall_s=0.0, loop_s=0.0, samples=0)
            if self.placement.driver.evaluates_start:  # else evaluated once the workers are up (_start)
                self.state = state
                self._start_eval(self._driver_eval())  # before the publish: not slowed by its copy
            self._publish_version0()
            return state
        load_trainer_state(self.trainer, checkpoint, parts)  # written at any number of ranks
        self.dir.rewind(self.trainer.step)
        kept = read_jsonl(self.dir.metrics)
        self.view.carry_last_eval(kept)  # `acc` until the next eval, not `-`
        self.telemetry.carry_ep_totals(kept)  # the cumulative ep/* bytes go on from the checkpoint's
        self.store.discard_after(self.trainer.version)
        if (latest := self.store.latest()) is None or latest.version < self.trainer.version:
            self.trainer.publish(self.store)  # pruned meanwhile: workers must start from the checkpoint's
        self.view.message(f"resumed at step {self.trainer.step} from {checkpoint}")
        return dict(parts["controller"])

    def _publish_version0(self) -> None:
        """Version 0 (the ``init_path`` weights) to the store, which keeps it like every durable version:
        a one-process trainer hands it to the store's background writer (a host snapshot now: the workers
        and the sync engine start from ``init_path``'s weights themselves, so nothing waits for the
        write); a trainer group publishes it at once (its ranks' workers may start from the store)."""
        if self.placement.trainer.is_group:
            self.trainer.publish(self.store)
        else:
            write_durable(self.store, self.trainer)

    def _start_rollouts(
        self, parts: dict | None, init_path: str | None, version: int, comp: Components | None
    ) -> Rollouts:
        """The rollout side the placement asks for (``moerl.runtime.start``), at policy ``version``;
        ``comp`` None while the trainer's thread builds it (``_start_overlapped``)."""
        # notices: where workers look for them (fleet.notice_file unset)
        start = RolloutsStart(
            self.cfg, self.placement, comp, init_path, self.store, version, parts, self.dir.path / "notices"
        )
        return start_rollouts(start)

    def _record(self, groups: list[Group], step: int) -> None:
        """Ledger (exactly-once accounting) and journal (trainer recovery) of the groups trained at ``step``."""
        self.dir.append_ledger(
            [
                LedgerEntry(
                    g.task_id,
                    step,
                    g.min_policy_version,
                    g.lease_token,
                    tuple(sorted({v for s in g.samples for v in s.policy_versions})),
                    sum(len(p.response_ids) for p in g.task.partial),
                )
                for g in groups
            ]
        )
        self.journal.record(step, [g.task for g in groups])

    def _publish(self, step: int) -> tuple[float, float]:
        """Publish the weights every ``publish_every`` steps and at the end; at the end also make the last
        version durable. A checkpoint step's version goes to the store too (in the background, as every
        ``durable_every``-th); a failed background write stops the run here (``WeightWriteError``).
        Returns the seconds of the hand-off and of that final save (0 on other steps): the save is the
        run's output, not a hand-off, and at 6.9 B takes tens of seconds of disk writes."""
        t1 = time.perf_counter()
        self.store.check_writes()
        is_last = step == self.cfg.trainer.steps
        if self._is_publish_step(step):
            # trainer -> transport -> workers (runtime.weight_sync, moerl.weights.transport); sync mode
            # hands the weights over in process
            self.rollouts.publish(self.trainer, is_durable=self._is_checkpoint_step(step) or is_last)
        elif self._is_checkpoint_step(step):  # not sent to the workers: only to the store
            write_durable(self.store, self.trainer)
        t2 = time.perf_counter()
        if not is_last:
            return t2 - t1, 0.0
        self.rollouts.make_durable(self.trainer)  # the last version is in the store once this returns
        return t2 - t1, time.perf_counter() - t2

    def _is_publish_step(self, step: int) -> bool:
        return step % self.cfg.trainer.publish_every == 0 or step == self.cfg.trainer.steps

    def _is_checkpoint_step(self, step: int) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return bool(every) and step % every == 0

    def _start_eval(self, result: EvalResult) -> None:
        """Record the eval of version 0 (after the warm start, if one ran) in the run's totals and say it on
        the console."""
        self.startup["start_eval"] = self._since_start()
        self._log_eval_samples(result, 0)
        self.state.update(
            start_accuracy=result.accuracy if result.metric == EXACT_MATCH else None,
            start_mean_reward=result.mean_reward,
            eval_metric=result.metric,
        )
        if result.metric == EXACT_MATCH:  # the status line's ``acc ...@0`` until the first RL eval
            self.view.carry_last_eval([{"step": 0, "eval/accuracy": result.accuracy}])
        self.view.message(
            f"{'warm-start' if fine_tunes(self.cfg) else 'start'} eval: {METRIC_NAMES[result.metric]} {result.accuracy:.3f} "
            f"({result.num_prompts} prompts); run folder {self.dir.path}"
        )

    def _evaluate(self, step: int) -> EvalResult | None:
        """Held-out evaluation every ``eval.every`` steps and at the end, else None."""
        every = self.cfg.eval.every
        is_due = step == self.cfg.trainer.steps or (every and step % every == 0)
        if not is_due:
            return None
        try:
            result = self._eval_result()
        except EvalVersionRefused as e:  # the workers refused this version (weights/refused_total): no eval
            self.view.message(f"step {step}: {e}")
            return None
        self._log_eval_samples(result, step)
        return result

    def _eval_result(self) -> EvalResult:
        """Held-out evaluation of the trainer's current version, every validation set
        (``moerl.tasks.eval.evaluate_sets``), where the placement evaluates (``Rollouts.evaluate``: on a
        rollout worker in async mode, the version published first; in process on the driver's copy)."""
        return evaluate_sets(self.comp.task.eval_sets(), lambda p: self.rollouts.evaluate(self.trainer, p))

    def _driver_eval(self) -> EvalResult:
        """Every validation set evaluated on the driver's copy of the policy."""
        return evaluate_sets(self.comp.task.eval_sets(), self.comp.evaluate)

    def _log_eval_samples(self, result: EvalResult, step: int) -> None:
        """Append the sampled eval responses (``eval.k``) to ``RUN_DIR/eval_samples.jsonl``, one per line."""
        records = sample_records(result, step)
        if records:
            with open(self.dir.eval_samples, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)

    def _fp8_gap(self, groups: list[Group]) -> LogprobGap | None:
        """The precision probe (``Rollouts.precision_gap``): with FP8 engine weights in the driver, beside
        the one-process trainer, the engine's log-prob gap and greedy agreement against the trainer's
        policy on this step's samples; None where the placement does not probe."""
        return self.rollouts.precision_gap(self.trainer, groups)

    def _log(
        self,
        groups: list[Group],
        stats: TrainStats,
        timings: StepTimings,
        accuracy,
        samples: int,
        t0: float,
        fp8_gap: LogprobGap | None = None,
    ) -> None:
        r = self.rollouts
        queue, buffer = r.queue_stats(), r.buffer_metrics()
        exact = accuracy.accuracy if accuracy is not None and accuracy.metric == EXACT_MATCH else None
        mean_reward = accuracy.mean_reward if accuracy is not None else None
        values = step_values(
            groups, stats, timings, queue, buffer, accuracy=exact, eval_mean_reward=mean_reward
        )
        if self.eval_keys is None:  # the same keys at every step: eval.k and the validation sets
            self.eval_keys = eval_keys(self.cfg.eval.k, list(self.comp.task.eval_sets()))
        values.update(eval_values(accuracy, self.eval_keys))
        if self.placement.rollout.is_fp8:
            values.update(fp8_values(fp8_gap, stats))
        values.update(r.fleet_values(self.cfg.trainer.batch_groups), policy_version=self.trainer.version)
        workers = (
            r.worker_stats()
        )  # async: one call to each live worker (threaded actors answer mid-generate)
        if "worker_first_put" not in self.startup:
            self._note_worker_startup(workers)
        values.update(kv_values([w.kv for w in workers]))  # the engines' KV cache counters
        if self.cfg.task.name == "env":  # multi-turn episodes (moerl.envs)
            values.update(env_step_values(groups, workers))
        s = self.state
        s["samples"] += samples
        s["loop_s"] += time.perf_counter() - t0
        s["wall_s"] = self.wall0 + time.perf_counter() - self.clock0
        record = self.telemetry.write_step(
            stats.step,
            s["wall_s"],
            values,
            groups=groups,
            workers=r.worker_records(),
            lags=r.policy_lags(),
            queue=queue,
            buffer=buffer,
            step_s=timings.step_s,
            weight_sync_s=timings.publish_s if self._is_publish_step(stats.step) else None,
        )
        self.view.update(record)
        if accuracy is not None:
            s["final_accuracy"], s["final_mean_reward"] = exact, mean_reward
            s["final_eval"] = {k: record[k] for k in self.eval_keys}

    def _checkpoint(self, step: int) -> None:
        if self._is_checkpoint_step(step):
            parts = {"controller": self.state, **self.rollouts.state_dict()}
            self.trainer.checkpoint(self.dir.path, parts, keep=self.cfg.runtime.keep_checkpoints)
            self.journal.commit(step)
            if self.mirror is not None:
                self.mirror.checkpoint(step)

    def _summary(self, fleet: FleetState, stop_reason: str | None) -> dict:
        """Final figures: accuracies, wall time, throughput and exactly-once task accounting."""
        s, trainer = self.state, self.trainer
        return {
            "status": "stopped" if stop_reason else "completed",
            "stop_reason": stop_reason,
            "mode": self.placement.run_mode,
            "steps": trainer.step,
            "skipped_steps": trainer.num_skipped,
            "eval_metric": s.get("eval_metric", EXACT_MATCH),
            "start_eval_accuracy": s["start_accuracy"],
            "final_eval_accuracy": s.get("final_accuracy"),
            "start_eval_mean_reward": s.get("start_mean_reward"),
            "final_eval_mean_reward": s.get("final_mean_reward"),
            "final_eval": s.get("final_eval", {}),  # eval/pass@k, eval/<set>/... of the last eval
            "wall_time_s": s["wall_s"],
            "samples_per_s": s["samples"] / max(s["loop_s"], 1e-9),
            "samples_trained": s["samples"],
            "reward_errors": fleet.reward_errors,
            **accounting(self.dir.read_ledger(), fleet),
            # seconds from the run's start to each start milestone (Run.startup): warm_start,
            # trainer_built, rollouts_started (async: after ray_started, workers_spawned,
            # exchange_ready), start_eval, first_groups, first_step, and the first worker's
            # (worker_*); a resumed run: its own
            "startup_s": dict(self.startup),
        }


def train(cfg: RunConfig, *, live: bool = True) -> dict:
    """Run RL training from scratch in a new run folder; returns the summary (also in summary.json).
    A local ``cfg.init_from`` is made absolute (so stored in ``config.yaml``: resumable from any folder).
    A Ray connection the run made (async mode) is shut down when it ends; one made before is kept.

    Raises:
        ConfigError: an invalid combination of settings, or a weight store URL that cannot be written.
        RunInterrupted: Ctrl-C or SIGTERM.
    """
    use_local_storage(cfg)
    if cfg.init_from is not None and not is_remote(cfg.init_from):  # stored absolute: resumable from anywhere
        cfg.init_from = str(Path(cfg.init_from).resolve())
    run_dir = RunDir.create(cfg)
    try:
        with (
            RunFolderLock(run_dir.path),
            stops_on_full_disk(run_dir.path),
            stops_on_lost_exchange(run_dir.path),
            sigterm_interrupts(),
            stops_ray_it_started(),  # a second run in this process starts its own, with its environment
        ):
            # a failure before step 1 leaves no half-written folder
            with run_dir.discarded_on_early_failure():
                run = Run(cfg, run_dir, live=live)
                run.start(checkpoint=None)
                return run.run()
    except KeyboardInterrupt as e:
        raise RunInterrupted.of(run_dir.path) from e
    except RewardFunctionError as e:  # the folder outlives a stop after step 1 (resumable once fixed)
        e.folder = run_dir.path if run_dir.path.exists() else None
        raise


def resume(run_dir: str | Path, overrides: list[str] | None = None, *, live: bool = True) -> dict:
    """Continue the run in ``run_dir`` from its newest complete checkpoint, with its own config; ``overrides``
    may change only ``moerl.run.resume.RESUME_FIELDS``.

    Raises:
        ConfigError: an override of a field a resume does not apply.
        FileNotFoundError: no run folder or no complete checkpoint in it.
        RunInterrupted: Ctrl-C or SIGTERM.
        RunFolderInUseError: another process runs or resumes the folder (nothing of it was touched).
    """
    fetched = None
    if is_remote(str(run_dir)):  # a stored run's URL: fetch its files and newest checkpoint first
        run_dir = fetched = fetch_for_resume(str(run_dir), overrides)  # the local copy is what gets rewound
    with removed_on_failure(fetched):  # a failed remote resume leaves no fetched folder behind
        check_resumable(run_dir)  # checked first: RunDir() creates the folder
    with RunFolderLock(run_dir):  # before anything is read back or rewound; held until the run ends
        return _resume(run_dir, fetched, overrides, live)


def _resume(run_dir: str | Path, fetched: Path | None, overrides: list[str] | None, live: bool) -> dict:
    """``resume`` of a local run folder whose lock this process holds."""
    with removed_on_failure(fetched):
        folder = RunDir(run_dir)
        cfg = resumed_config(folder.config, overrides)  # the run's own, with what a resume may change
        done = folder.read_summary(damaged="warn")  # the checkpoints decide: a damaged one is not "done"
        if done and done.get("status") == "completed" and done.get("steps", 0) >= cfg.trainer.steps:
            ckpt = latest_checkpoint(folder.path, contents=False)  # named in a message, not loaded
            how = (
                f"to continue it from its newest checkpoint ({ckpt.name}; later steps are trained again): "
                f"moerl train --resume {run_dir} --set trainer.steps=N (N > {done['steps']})"
                if ckpt is not None
                else "it has no checkpoint to continue from (trainer.checkpoint_every)"
            )
            print(f"moerl: {run_dir} is already complete ({done['steps']} steps); {how}")
            return done
        check_init_from(cfg, folder.path, folder.config)  # relative ones from the folder the run began in
        ckpt = resume_checkpoint(folder.path, cfg)  # the newest complete one; skipped ones named
    try:
        with (
            stops_on_full_disk(folder.path),
            stops_on_lost_exchange(folder.path),
            sigterm_interrupts(),
            stops_ray_it_started(),
        ):
            run = Run(cfg, folder, live=live)
            with removed_on_failure(fetched):
                run.start(checkpoint=ckpt)
            return run.run()
    except KeyboardInterrupt as e:
        raise RunInterrupted.of(folder.path) from e
    except RewardFunctionError as e:
        e.folder = folder.path
        raise


def one_line(error: BaseException | str) -> str:
    """``error`` as one line for the console: a message that carries a rank's traceback (``TrainerRankError``)
    becomes its first line and its last (the exception raised), e.g. ``trainer rank 1, train_step: ...
    RuntimeError: Timed out waiting 8000ms for recv operation to complete``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(error).__name__
    return f"{lines[0]} ... {lines[-1]}"


def export_policy(trainer: Trainer, tokenizer, folder: Path, init_path: str | None = None) -> Path:
    """Save the policy as a Hugging Face folder with its tokenizer (what ``moerl generate`` and
    transformers load), replacing ``folder`` atomically (``Trainer.export_policy``: ``save_pretrained`` of the
    one-process trainer's model, or streamed from the shards of a trainer group). The tokenizer's files
    keep what they were loaded with (chat template, special tokens), and ``init_path``'s
    ``generation_config.json`` is copied (``save_tokenizer_and_companions``)."""
    return trainer.export_policy(
        folder, extra=lambda out: save_tokenizer_and_companions(tokenizer, init_path, out)
    )


def _open_mirror(cfg: RunConfig, run_dir: RunDir) -> RunMirror | None:
    """``RunMirror.from_config``, with a URL whose filesystem cannot be opened a ``ConfigError``."""
    try:
        return RunMirror.from_config(cfg, run_dir.path)
    except (OSError, ValueError, ImportError) as e:  # fsspec: unknown protocol, unreachable host, no driver
        raise ConfigError(f"storage.url={cfg.storage.url!r} cannot be opened: {type(e).__name__}: {e}") from e


def _open_store(cfg: RunConfig, run_dir: RunDir, mirror: RunMirror | None) -> WeightStore:
    """The run's weight store: ``runtime.store_url``, else the run folder's ``weights/``.

    Raises:
        ConfigError: the store cannot be written.
    """
    url = cfg.runtime.store_url or (mirror.weights_url if mirror else str(run_dir.weights))  # <run>/weights
    # the field the user set: the store of storage.url is <storage.url>/<run>/weights
    field = "runtime.store_url" if cfg.runtime.store_url else "storage.url" if mirror else "output_dir"
    options = cfg.storage.options if is_remote(url) else None
    try:
        return WeightStore(url, keep=cfg.runtime.keep_versions, storage_options=options)
    except StoreNotWritableError as e:
        raise ConfigError(f"{field}: {e}") from e
    except (OSError, ValueError, ImportError) as e:  # fsspec: unknown protocol, unreachable host, no driver
        raise ConfigError(f"{field}: weight store {url!r} cannot be opened: {type(e).__name__}: {e}") from e


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
