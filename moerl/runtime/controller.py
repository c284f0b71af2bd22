"""The main job: ``train(cfg)`` wires task, fleet, buffer, trainer and weight store, and runs GRPO.

    warm start (SFT unless init_from) -> eval -> loop {take a batch of groups, train, publish,
    eval, log, checkpoint} -> eval -> summary

The fleet is ``LocalFleet`` (sync: one process, no Ray, generate-then-train, on-policy) or
``RayFleet`` (async: rollout workers as Ray actors generating while the trainer trains; they meet the
trainer only through the bounded buffer, the queue and the weight store). Everything else is shared.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch

from moerl.config import ConfigError, RunConfig, load_config
from moerl.envs.stats import merge as env_merge
from moerl.envs.stats import step_values as env_step_values
from moerl.runtime.allocator import keep_freed_memory
from moerl.runtime.chaos import ChaosMonkey
from moerl.runtime.checkpoint import latest_checkpoint, load_checkpoint, restore_rng_state
from moerl.runtime.recovery import StepJournal, recover_trainer
from moerl.runtime.run_dir import LedgerEntry, RunDir
from moerl.runtime.setup import (
    Components,
    accounting,
    build_components,
    discard_versions_after,
    evaluate,
    warm_start,
)
from moerl.runtime.trainer import NonFiniteLossError, Trainer
from moerl.runtime.weights import StoreNotWritableError, WeightStore
from moerl.telemetry.live import LiveView
from moerl.telemetry.metrics import MetricsWriter
from moerl.telemetry.report import plot_report
from moerl.telemetry.step import StepTimings, step_values


def train(cfg: RunConfig, *, live: bool = True) -> dict:
    """Run RL training from scratch in a new run folder; returns the summary (also in summary.json).

    Raises:
        ConfigError: an invalid combination of settings, or a weight store URL that cannot be written.
    """
    run = RunDir.create(cfg)
    try:
        # a failure before step 1 leaves no half-written folder
        with _sigterm_interrupts(), run.discarded_on_early_failure():
            return _run(cfg, run, checkpoint=None, live=live)
    except KeyboardInterrupt as e:
        e.run_dir = _resumable(run.path)  # for the CLI's hint
        e.partial_run_dir = run.path if run.path.is_dir() else None  # steps taken, no checkpoint yet
        raise


def resume(run_dir: str | Path, overrides: list[str] | None = None, *, live: bool = True) -> dict:
    """Continue the run in ``run_dir`` from its newest checkpoint (config overrides allowed).

    Raises:
        FileNotFoundError: no run folder or no complete checkpoint in it.
    """
    if not (Path(run_dir) / "config.yaml").exists():  # checked first: RunDir() creates the folder
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    run = RunDir(run_dir)
    cfg = load_config(run.config, overrides)
    done = run.read_summary()
    if done and done.get("status") == "completed" and done.get("steps", 0) >= cfg.trainer.steps:
        print(
            f"moerl: {run_dir} is already complete ({done['steps']} steps); to continue it: "
            f"moerl train --resume {run_dir} --set trainer.steps=N (N > {done['steps']})"
        )
        return done
    ckpt = latest_checkpoint(run.path)
    if ckpt is None:
        every = cfg.trainer.checkpoint_every
        raise FileNotFoundError(
            f"{run_dir} has no complete checkpoint to resume from (trainer.checkpoint_every={every}: "
            + ("checkpoints are off)" if every == 0 else f"the first is written at step {every})")
        )
    try:
        with _sigterm_interrupts():
            return _run(cfg, run, checkpoint=ckpt, live=live)
    except KeyboardInterrupt as e:
        e.run_dir = _resumable(run.path)
        raise


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts():
    """While a run lasts, SIGTERM (a scheduler or ``kill`` stopping the job) stops it as Ctrl-C does:
    workers are stopped, the newest checkpoint stays, and the CLI prints the ``--resume`` hint and exits
    130. The previous handler comes back afterwards. Only from the main thread (Python's rule). ``RayFleet``
    keeps it across ``ray.init``, which would install Ray's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resumable(path: Path) -> Path | None:
    """``path`` if it holds a checkpoint that ``resume`` can continue from, else ``None``."""
    return path if path.is_dir() and latest_checkpoint(path) is not None else None


def export_policy(model: torch.nn.Module, tokenizer, folder: Path) -> Path:
    """Save the policy as a Hugging Face folder with its tokenizer (what ``moerl generate`` and
    transformers load), replacing ``folder`` atomically (``save_pretrained``)."""
    from moerl.models import save_pretrained

    save_pretrained(model, folder, extra=tokenizer.save)
    return folder


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _run(cfg: RunConfig, run: RunDir, *, checkpoint: Path | None, live: bool) -> dict:
    process_start = time.perf_counter()
    keep_freed_memory()  # no page faults on each step's activations (moerl.runtime.allocator)
    _seed_everything(cfg.seed)
    view = LiveView(cfg.trainer.steps, enabled=live)
    try:
        store = WeightStore(cfg.runtime.store_url or str(run.weights), keep=cfg.runtime.keep_versions)
    except StoreNotWritableError as e:
        raise ConfigError(f"runtime.store_url: {e}") from e
    if cfg.runtime.mode == "async" and cfg.runtime.ray_address:  # before the warm start, not after
        from moerl.runtime.actors import check_ray_address

        check_ray_address(cfg.runtime.ray_address)
    init_path = warm_start(cfg, run, view)
    parts = load_checkpoint(checkpoint) if checkpoint is not None else None
    comp: Components = build_components(cfg, init_path, store)
    trainer = Trainer.from_run_config(comp.model, cfg)
    if parts is None:
        trainer.publish(store)  # version 0: what the workers start from
        acc = evaluate(comp)
        state = {"start_accuracy": acc, "wall_s": 0.0, "loop_s": 0.0, "samples": 0}
        view.message(f"warm-start eval accuracy {acc:.3f}; run folder {run.path}")
    else:
        trainer.load_state_dict(parts)
        state = dict(parts["controller"])
        run.rewind(trainer.step)
        discard_versions_after(store, trainer.version)
        if (latest := store.latest()) is None or latest.version < trainer.version:
            trainer.publish(store)  # pruned meanwhile: workers must start from the checkpoint's weights
        view.message(f"resumed at step {trainer.step} from {checkpoint}")
    if cfg.runtime.mode == "async" and cfg.fleet.notice_file is None:  # where workers look for notices
        cfg.fleet.notice_file = str(run.path / "notices" / "{worker_id}.json")
    fleet = comp.start_fleet(trainer.version, parts)
    chaos, journal, restarts = ChaosMonkey(cfg.chaos), StepJournal(), 0
    if parts is not None:
        restore_rng_state(parts["rng"])
    metrics = MetricsWriter(run.metrics)
    start, wall0, stop_reason, acc = time.perf_counter(), state["wall_s"], None, None
    try:
        while trainer.step < cfg.trainer.steps:
            t0 = time.perf_counter()
            groups, gen_s, wait_s = fleet.next_groups(cfg.trainer.batch_groups)
            batch = trainer.build_batch(groups, comp.tokenizer.pad_id)
            stats = trainer.train_step(batch)
            run.append_ledger(
                [LedgerEntry(g.task_id, stats.step, g.min_policy_version, g.lease_token) for g in groups]
            )
            journal.record(stats.step, [g.task for g in groups])
            if chaos.should_kill_trainer(stats.step):  # dies before publishing; the fleet keeps generating
                trainer, report = recover_trainer(cfg, comp, run, store, fleet, journal, stats.step)
                restarts += 1
                view.message(
                    f"trainer killed after step {stats.step}: restarted from step {report.restored_step}, "
                    f"{report.tasks_requeued} tasks requeued, weights published as v{report.version}"
                )
                continue
            t1 = time.perf_counter()
            if stats.step % cfg.trainer.publish_every == 0 or stats.step == cfg.trainer.steps:
                trainer.publish(store)
                fleet.push_weights(trainer.version, trainer.named_weights())
            publish_s = time.perf_counter() - t1
            is_eval = stats.step == cfg.trainer.steps or (cfg.eval.every and stats.step % cfg.eval.every == 0)
            acc = evaluate(comp) if is_eval else None
            timings = StepTimings(
                gen_s=gen_s, wait_s=wait_s, publish_s=publish_s, step_s=time.perf_counter() - t0
            )
            values = step_values(
                groups, stats, timings, fleet.queue_stats(), fleet.buffer_metrics(), accuracy=acc
            )
            values.update(fleet.fleet_values(cfg.trainer.batch_groups), policy_version=trainer.version)
            if cfg.task.name == "env":  # multi-turn episodes (moerl.envs)
                values.update(env_step_values(groups, fleet.worker_stats()))
            state["samples"] += batch.num_sequences
            state["loop_s"] += time.perf_counter() - t0
            state["wall_s"] = wall0 + time.perf_counter() - start
            view.update(metrics.write(stats.step, state["wall_s"], values))
            if acc is not None:
                state["final_accuracy"] = acc
            if cfg.trainer.checkpoint_every and stats.step % cfg.trainer.checkpoint_every == 0:
                trainer.checkpoint(
                    run.path, {"controller": state, **fleet.state_dict()}, keep=cfg.runtime.keep_checkpoints
                )
                journal.commit(stats.step)
    except NonFiniteLossError as e:
        stop_reason = str(e)
        view.message(f"stopping: {e}")
    except BaseException:
        fleet.close()
        view.close()
        raise
    fleet_state = fleet.final_state()
    fleet_summary = {**fleet.fleet_summary(), "trainer_restarts": restarts}
    env_summary = env_merge([w.env for w in fleet.worker_stats()]) if cfg.task.name == "env" else None
    fleet.close()
    view.close()
    summary = {**_summary(cfg, run, trainer, state, fleet_state, stop_reason), "fleet": fleet_summary}
    if env_summary is not None:
        summary["env"] = env_summary
    summary["policy"] = str(export_policy(trainer.model, comp.tokenizer, run.path / "policy"))
    summary["process_wall_s"] = time.perf_counter() - process_start  # this process: warm start + evals + RL
    run.write_summary(summary)
    if run.metrics.exists():
        plot_report(run.path)
    view.message(
        f"done: accuracy {summary['start_eval_accuracy']:.3f} -> {_accuracy(summary['final_eval_accuracy'])}, "
        f"{summary['wall_time_s']:.0f} s; {run.path}"
    )
    return summary


def _accuracy(value: float | None) -> str:
    """An accuracy with three decimals, or "not evaluated"."""
    return "not evaluated" if value is None else f"{value:.3f}"


def _summary(cfg: RunConfig, run: RunDir, trainer: Trainer, state: dict, fleet_state, stop_reason) -> dict:
    """Final figures: accuracies, wall time, throughput and exactly-once task accounting."""
    loop_s = max(state["loop_s"], 1e-9)
    return {
        "status": "stopped" if stop_reason else "completed",
        "stop_reason": stop_reason,
        "mode": cfg.runtime.mode,
        "steps": trainer.step,
        "skipped_steps": trainer.num_skipped,
        "start_eval_accuracy": state["start_accuracy"],
        "final_eval_accuracy": state.get("final_accuracy"),
        "wall_time_s": state["wall_s"],
        "samples_per_s": state["samples"] / loop_s,
        "samples_trained": state["samples"],
        "reward_errors": fleet_state.reward_errors,
        **accounting(run.read_ledger(), fleet_state),
    }
