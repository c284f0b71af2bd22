"""Async mode evaluates on a rollout worker (issue 34): the figures equal an in-process eval of the same
saved versions; the driver evaluates only version 0 in process (a one-process trainer holds the policy
anyway: it evaluates it while the workers start, issue 32)."""

import os
import threading
from pathlib import Path

import pytest
from conftest import short_config

from moerl import train as train_module
from moerl.models import from_pretrained
from moerl.placement import RAY_ACTORS
from moerl.rundir.folder import RunDir, read_jsonl
from moerl.runtime import start as start_module
from moerl.runtime.build import Components
from moerl.tasks import make_task
from moerl.tasks.eval import evaluate
from moerl.tasks.tokenizer import load_run_tokenizer
from moerl.train import train
from moerl.weights.store import WeightStore

pytestmark = pytest.mark.ray_group("ray_a")  # one Ray instance with test_env_runs and test_verl_example


@pytest.mark.timeout(300)
def test_async_eval_accuracy_equals_evaluating_the_saved_version_in_process(
    tmp_path, tiny_init, shared_ray, monkeypatch
):
    """Every eval of the run after the start (steps 1 and 2) is a worker's: the driver's in-process eval
    runs once, for version 0, before any step. Each figure equals ``moerl.tasks.eval.evaluate`` of that
    version from the weight store."""
    e2e = str(Path(__file__).parent)  # the workers import e2e_rewards
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (e2e, os.environ.get("PYTHONPATH")) if p))

    driver_evals = []
    in_process = Components.evaluate

    def start_eval_only(self, *args):
        if driver_evals:
            raise AssertionError("the driver evaluated in process after the start")
        driver_evals.append(1)
        return in_process(self, *args)

    monkeypatch.setattr(Components, "evaluate", start_eval_only)
    # the rollout workers start while the trainer is built: the build waits for their start to begin
    rollouts_starting, trainer_waited = threading.Event(), []
    ray_rollouts, make_trainer = start_module.ROLLOUT_SIDES[RAY_ACTORS], train_module.make_trainer

    def starting_rollouts(*args, **kwargs):
        rollouts_starting.set()
        return ray_rollouts(*args, **kwargs)

    def trainer_after_rollouts_begin(*args, **kwargs):
        trainer_waited.append(rollouts_starting.wait(60))
        return make_trainer(*args, **kwargs)

    monkeypatch.setitem(start_module.ROLLOUT_SIDES, RAY_ACTORS, starting_rollouts)
    monkeypatch.setattr(train_module, "make_trainer", trainer_after_rollouts_begin)
    cfg = short_config(
        tmp_path,
        tiny_init,
        "runtime.mode=async",
        # one worker: it serves the evals and generates; a second (an actor process importing torch and
        # building the policy: ~10 s of CPU) would change no figure here
        "rollout.num_workers=1",
        "trainer.steps=2",
        "eval.every=1",
        "runtime.weight_sync=store",
        "runtime.keep_versions=5",
        "task.num_eval=24",
        "rollout.max_new_tokens=6",
        "task.reward_fn=e2e_rewards:first_is_digit",  # a fresh policy's accuracy is neither 0 nor 1
        "trainer.lr=0.05",  # the versions differ
    )
    summary = train(cfg, live=False)
    run = RunDir(next(Path(tmp_path).glob("run-*")))
    evals = {r["step"]: r["eval/accuracy"] for r in read_jsonl(run.metrics)}
    assert set(evals) == {1, 2} and driver_evals == [1]
    assert trainer_waited == [True]  # built while the rollouts started, not before them
    startup = summary["startup_s"]
    driver = [k for k in startup if not k.startswith("worker_")]
    assert sorted(driver) == sorted(
        ["warm_start", "rollouts_started", "trainer_built", "start_eval", "first_groups", "first_step"]
        + ["ray_started", "workers_spawned", "exchange_ready"]  # the async rollout side's own milestones
    )
    assert startup["ray_started"] <= startup["workers_spawned"] <= startup["rollouts_started"]
    # the trainer is built and version 0 evaluated while the rollouts start; both before the first groups
    assert startup["warm_start"] <= startup["trainer_built"] <= startup["start_eval"]
    assert startup["warm_start"] <= startup["rollouts_started"]
    assert max(startup["rollouts_started"], startup["start_eval"]) <= startup["first_groups"]
    assert startup["first_groups"] <= startup["first_step"]
    # the first worker's start on the same clock: spawned after warm start, its groups before the step's
    w = [startup[f"worker_{k}"] for k in ("init", "policy_loaded", "ready", "first_put")]
    assert startup["warm_start"] <= w[0] <= w[1] <= w[2] <= w[3] <= startup["first_groups"] + 1.0
    # the same versions, loaded from the run's weight store into the initial policy, evaluated here
    tokenizer = load_run_tokenizer(cfg, str(tiny_init))
    task = make_task(cfg.task, cfg.env)
    store, model = WeightStore(str(run.weights)), from_pretrained(str(tiny_init))
    r = cfg.rollout
    got = {}
    for version in (0, 1, 2):
        model.load_state_dict(store.load(version))
        got[version] = evaluate(
            model,
            tokenizer,
            task,
            max_new_tokens=r.max_new_tokens,
            max_slots=r.max_slots,
            kv_token_budget=r.kv_token_budget,
        ).accuracy
    assert summary["start_eval_accuracy"] == got[0]
    assert evals == {1: got[1], 2: got[2]} and summary["final_eval_accuracy"] == got[2]
    assert len(set(got.values())) > 1  # the versions score differently: the one evaluated matters


@pytest.mark.timeout(300)
def test_a_trainer_that_fails_to_build_stops_the_rollouts_started_beside_it(
    tmp_path, tiny_init, shared_ray, monkeypatch
):
    """The overlapped start (``Run._start_overlapped``): the trainer's build failing after the rollout
    workers started raises the build's error and closes the rollouts (no worker left running)."""
    closed = []
    ray_rollouts = start_module.ROLLOUT_SIDES[RAY_ACTORS]

    def tracked(*args, **kwargs):
        rollouts = ray_rollouts(*args, **kwargs)
        close = rollouts.close
        rollouts.close = lambda: (closed.append(True), close())[1]
        return rollouts

    def broken_trainer(*args, **kwargs):
        raise RuntimeError("trainer build failed here")

    monkeypatch.setitem(start_module.ROLLOUT_SIDES, RAY_ACTORS, tracked)
    monkeypatch.setattr(train_module, "make_trainer", broken_trainer)
    cfg = short_config(tmp_path, tiny_init, "runtime.mode=async", "rollout.num_workers=1", "trainer.steps=2")
    with pytest.raises(RuntimeError, match="trainer build failed here"):
        train(cfg, live=False)
    assert closed and closed[0] is True  # the workers started beside the build were stopped
