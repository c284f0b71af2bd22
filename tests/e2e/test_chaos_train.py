"""Chaos end to end on a local Ray cluster (async mode, default tiny model, 4 rollout workers in the worker
chaos run; 2 in its undisturbed run and for the trainer's kill).

- Worker chaos: 2 workers SIGKILLed and 1 given a spot-style notice at random times; the run completes,
  every task id is trained exactly once (ledger), requeues and lost work are reported, and the final
  accuracy is within noise of an undisturbed run with the same seed.
- Trainer chaos: the trainer is killed mid-run and restarted from the last full checkpoint while the
  workers keep generating; the run completes and the accounting still holds.
- Fleet machinery with model-free stand-in workers: a SIGKILLed worker is detected and replaced, a
  worker given a notice file or a SIGTERM drains, exits and is replaced.

The policy starts from a fresh model of ``configs/default.yaml``'s shape; the reward is
``e2e_rewards:first_is_digit`` with a learning rate at which 16 steps raise the held-out accuracy from
about 0.05 while keeping it well inside (0, 1), so the two runs' accuracies can be compared.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from _runs import DEFAULT_CONFIG, assert_trained_exactly_once, newest_run, run_config

from moerl.config import ChaosConfig, FleetConfig
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.runtime.chaos import ChaosMonkey
from moerl.runtime.drain import DrainReport
from moerl.runtime.fleet import FleetManager, WorkerExit, WorkerHealth, WorkerState
from moerl.runtime.notice import watcher_from_config
from moerl.train import train

pytestmark = pytest.mark.usefixtures("no_report_figures")  # no test here reads report.png

STEPS, BATCH, NUM_EVAL = 16, 8, 100
ACCURACY_NOISE = 0.3
"""Largest final-accuracy difference between two runs that counts as noise: 3.5 standard deviations of
the difference of two undisturbed runs of this config (5 undisturbed runs, same seed, 2 loaded cores:
0.68 0.68 0.62 0.77 0.64, std 0.058; 3.5 * sqrt(2) * 0.058 = 0.29). Async runs differ by the fleet's
timing, which the machine's load changes; chaos runs of the same config gave 0.57 0.87 0.63 0.55."""


def _config(out: Path, init: Path, *overrides: str, steps: int = STEPS):
    return run_config(
        DEFAULT_CONFIG,
        out,
        init,
        "runtime.mode=async",
        "rollout.num_workers=4",
        f"trainer.steps={steps}",
        f"trainer.batch_groups={BATCH}",
        "trainer.lr=2e-4",
        "trainer.warmup_steps=10",
        "trainer.micro_batch_size=256",
        "runtime.max_staleness=1",
        "runtime.buffer_groups=64",
        "rollout.max_slots=16",
        "runtime.lease_ttl_s=10",
        "trainer.checkpoint_every=0",
        "eval.every=0",
        f"task.num_eval={NUM_EVAL}",
        "task.reward_fn=e2e_rewards:first_is_digit",
        "fleet.check_every_s=0.5",
        "fleet.notice_poll_s=0.2",
        "fleet.drain_grace_s=5",
        *overrides,
    )


def _train(cfg) -> tuple[dict, RunDir]:
    summary = train(cfg, live=False)
    return summary, newest_run(cfg)


def _assert_exactly_once(summary: dict, run: RunDir, steps: int = STEPS) -> None:
    assert_trained_exactly_once(summary, run, steps, BATCH)
    versions = [r["policy_version"] for r in read_jsonl(run.metrics)]
    assert versions == sorted(set(versions))  # strictly increasing: versions never go backwards


@pytest.mark.timeout(300)
def test_chaos_kills_and_notice_lose_nothing(local_ray, default_init, tmp_path):
    # the undisturbed run with 2 workers: its figures are what 16 steps of 8 groups at staleness <= 1 teach
    # (the trainer consumes the same batches whoever generated them); 2 fewer worker processes to start,
    # each importing torch and building the policy (~10 s of CPU). The chaos run keeps 4: 3 of them are hit.
    calm, calm_run = _train(_config(tmp_path / "calm", default_init, "rollout.num_workers=2"))
    chaos, chaos_run = _train(
        _config(
            tmp_path / "chaos",
            default_init,
            # short intervals: all three faults land within about a second of the workers' first
            # generation, so an unloaded machine that trains the 16 steps quickly still sees them all
            "chaos.kill_rollout_every_s=0.3",
            "chaos.max_kills=2",
            "chaos.notice_rollout_every_s=0.45",
            "fleet.check_every_s=0.1",  # a 16-step run lasts a few seconds: look for due faults often
            "chaos.max_notices=1",
            "chaos.seed=1",
        )
    )
    for summary, run in ((calm, calm_run), (chaos, chaos_run)):
        assert summary["status"] == "completed" and summary["steps"] == STEPS
        _assert_exactly_once(summary, run)
    fleet = chaos["fleet"]
    assert fleet["chaos"] == {"kill": 2, "notice": 1}
    assert (fleet["killed"], fleet["drained"], fleet["interruptions"]) == (2, 1, 3)
    # losses seen during the run are replaced (one seen only when the run ends is not)
    assert 4 + 1 <= fleet["spawned"] <= 4 + 3
    assert fleet["time_to_replace_s"] is None or fleet["time_to_replace_s"] > 0
    assert 0.0 <= fleet["lost_work_frac"] < 1.0 and fleet["tokens_generated"] > 0
    assert calm["fleet"]["interruptions"] == 0 and calm["fleet"]["lost_work_frac"] == 0.0
    last = read_jsonl(chaos_run.metrics)[-1]  # metrics report the fleet too (faults after it come later)
    assert last["fleet/workers_alive"] >= 1 and last["fleet/lost_work_frac"] is not None
    assert 0 <= last["fleet/interruptions"] <= 3 and 0 <= last["queue/requeued"] <= chaos["tasks_requeued"]
    assert chaos["tasks_requeued"] >= fleet["tasks_expired"] + fleet["tasks_released"] > 0
    for summary in (calm, chaos):  # both learned (a fresh policy starts near 0.05) ...
        assert summary["final_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.3
    # ... and the chaos run as well as the undisturbed one, within noise
    assert abs(chaos["final_eval_accuracy"] - calm["final_eval_accuracy"]) <= ACCURACY_NOISE
    print(
        f"\nchaos figures: {fleet}; wall {chaos['wall_time_s']:.1f} s vs undisturbed {calm['wall_time_s']:.1f} s; "
        f"accuracy {chaos['final_eval_accuracy']:.3f} vs {calm['final_eval_accuracy']:.3f}; "
        f"requeued {chaos['tasks_requeued']}"
    )


@pytest.mark.timeout(300)
def test_trainer_kill_restarts_from_checkpoint(local_ray, default_init, tmp_path):
    steps = 8  # no accuracy comparison here: a shorter run
    # 2 rollout workers, not 4: the assertions are about the trainer's restart and what it trains, which
    # any generating fleet shows; 2 fewer worker processes to start (each imports torch, builds the policy)
    summary, run = _train(
        _config(
            tmp_path,
            default_init,
            "rollout.num_workers=2",
            "trainer.checkpoint_every=2",
            "chaos.kill_trainer_at_step=5",
            steps=steps,
        )
    )
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["fleet"]["trainer_restarts"] == 1
    _assert_exactly_once(summary, run, steps)
    versions = [r["policy_version"] for r in read_jsonl(run.metrics)]
    # killed after step 5, before publishing it: versions 1-4 were published, the checkpoint is of step 4;
    # the restored weights are published as version 5, so step 5 again is version 6 ... step 8 is 9
    assert versions == [1, 2, 3, 4, 6, 7, 8, 9]
    # the staleness rule decided what the restarted trainer used: groups generated meanwhile with the
    # dead trainer's last published weights (version <= 4), none older than its version - max_staleness
    ledger = run.read_ledger()
    assert any(e.step >= 5 and e.policy_version <= 4 for e in ledger)
    before = {r["step"]: r["policy_version"] - 1 for r in read_jsonl(run.metrics)}  # version a step starts at
    assert all(e.policy_version >= before[e.step] - 1 for e in ledger)  # runtime.max_staleness = 1


# -- the fleet machinery alone, with model-free stand-in workers ----------------------------------


class StandInWorker:
    """Counts 'tokens' until stopped or noticed; answers health with its pid."""

    def __init__(self, worker_id: str, notice_dir: str):
        self.worker_id = worker_id
        cfg = FleetConfig(notice_poll_s=0.05, handle_sigterm=True)
        self.watcher = watcher_from_config(cfg, worker_id, default_notice_dir=notice_dir).start()
        self.stopped = threading.Event()
        self.tokens = 0

    def run(self):
        while not self.stopped.is_set() and not self.watcher.is_set():
            time.sleep(0.02)
            self.tokens += 1
        self.watcher.stop(resend_sigterm_after_s=0.5)  # after a SIGTERM notice, Ray's handler ends us
        if self.watcher.is_set():
            report = DrainReport(
                groups_delivered=0,
                groups_released=1,
                tokens_kept=0,
                tokens_discarded=3,
                seconds=0.0,
                grace_s=90.0,
            )
            return WorkerExit(self.worker_id, "drained", drain=report, final=self.health())
        return WorkerExit(self.worker_id, "stopped", final=self.health())

    def health(self):
        return WorkerHealth(tokens_delivered=self.tokens, pid=os.getpid(), hostname=socket.gethostname())

    def stop(self):
        self.stopped.set()

    def loaded_torch(self) -> bool:
        return "torch" in sys.modules


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(cond, fleet, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        fleet.check()
        if cond():
            return True
        time.sleep(0.1)
    return False


STAND_INS = 3
"""Stand-in workers of the fleet test: one for each fault (a kill, a notice file, a SIGTERM), so every
original worker is hit. Each is an actor process that loads the fleet's records (``moerl.runtime.fleet``,
``moerl.runtime.drain``) but not torch: a start is Ray's own import, about 1.5 CPU-s instead of 5."""


@pytest.mark.timeout(120)
def test_kill_and_notice_are_detected_and_replaced(local_ray, tmp_path):
    from moerl.runtime.ray.backend import RayWorkerBackend

    actor_cls = ray.remote(num_cpus=0, max_concurrency=3)(StandInWorker)
    backend = RayWorkerBackend(
        lambda wid: actor_cls.remote(wid, str(tmp_path)), notice_path=lambda wid: tmp_path / f"{wid}.json"
    )
    fleet = FleetManager(backend, num_workers=STAND_INS, heartbeat_timeout_s=20.0)
    fleet.start()
    assert _wait_until(lambda: len(fleet.alive_ids()) == STAND_INS, fleet)
    chaos = ChaosMonkey(
        ChaosConfig(kill_rollout_every_s=0.2, notice_rollout_every_s=0.2, max_kills=1, max_notices=1, seed=1)
    )
    actions = []
    while len(actions) < 2:
        actions += chaos.due(fleet.alive_ids())
        time.sleep(0.05)
    chaos.apply(actions, backend)
    victims = {a.kind: a.worker_id for a in actions}
    sigterm_victim = sorted(set(fleet.alive_ids()) - set(victims.values()))[0]
    host, pid = backend._where[sigterm_victim]  # noqa: SLF001 - the pid its health answers reported
    os.kill(pid, signal.SIGTERM)  # a SIGTERM is a notice too: it drains, then exits
    victims["sigterm"] = sigterm_victim
    assert _wait_until(
        lambda: fleet.metrics().interruptions == 3 and len(fleet.alive_ids()) == STAND_INS, fleet
    )
    assert fleet.records[victims["kill"]].state is WorkerState.KILLED
    assert fleet.records[victims["notice"]].state is WorkerState.DRAINED
    assert fleet.records[victims["sigterm"]].state is WorkerState.DRAINED
    m = fleet.metrics()
    assert (m.killed, m.drained, m.replaced, m.workers_alive) == (1, 2, 3, STAND_INS)
    assert m.tokens_discarded == 6 and 0 < m.lost_work_frac < 1 and m.time_to_replace_s > 0
    assert _wait_until(lambda: not _pid_alive(pid), fleet, timeout_s=30)  # the SIGTERMed process exited
    # the replacements' processes never loaded torch: the fleet's records (WorkerExit, DrainReport) do without it
    assert ray.get([h.loaded_torch.remote() for h in backend.alive_handles()]) == [False] * STAND_INS
    exits = backend.stop_all()
    assert sorted(e.reason for e in exits) == ["stopped"] * STAND_INS
