"""runtime.weight_sync=collective end to end over gloo on CPU.

- ``ep_group_run``: async mode, a 2-rank trainer (FSDP2 x EP 2, Ray rank actors) and one rollout worker
  that is a 2-rank EP group (rollout.ep_size=2). Trainer rank 0 broadcasts every version's buckets to both
  rollout ranks through their own group; the run completes, learns, and trains every task exactly once;
  the worker reports its 2 EP ranks and the evals are the EP group's (the driver holds no policy). One run
  read by two tests: the 2-rank rollout group's checks and the collective transport's.
- A killed one-rank worker: the sender drops its weight group and the fleet replaces it.
"""

from __future__ import annotations

import pytest
from _runs import DEFAULT_CONFIG, assert_trained_exactly_once, newest_run, run_config

from moerl.models import from_pretrained
from moerl.rundir.folder import read_jsonl
from moerl.tasks import make_task
from moerl.tasks.eval import evaluate
from moerl.tasks.tokenizer import load_run_tokenizer
from moerl.train import train

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("no_report_figures")  # no test here reads report.png

STEPS, BATCH = 12, 4
MARGIN = 0.25
""""Rising": held-out accuracy after the last step at least this much above the warm start's (the
fresh policy answers a digit first almost never; ``first_is_digit`` is learnt within a few steps at
lr 3e-3, as in tests/distributed/test_async_sharded.py, whose margin is 0.3 after 24 steps)."""


@pytest.fixture(scope="module")
def ep_group_run(local_ray, default_init, tmp_path_factory):
    """(config, summary) of the module's one async run of a 2-rank trainer (EP 2) and one rollout worker
    that is a 2-rank EP group, weights by broadcast (``runtime.weight_sync=collective``): read by the
    2-rank rollout group's test and by the collective transport's (one run of 4 rank processes instead of
    two: each rank imports torch and builds the sharded policy, tens of seconds of the loaded 2 cores)."""
    cfg = run_config(
        DEFAULT_CONFIG,
        tmp_path_factory.mktemp("ep_group_run"),
        default_init,
        "runtime.mode=async",
        "runtime.weight_sync=collective",
        "runtime.durable_every=4",  # the store every 4th version (and the last): the rest by broadcast only
        "runtime.publish_bucket_mb=0.25",  # several buckets a version
        "rollout.num_workers=1",
        "rollout.ep_size=2",
        "trainer.num_ranks=2",
        "trainer.ep_size=2",
        f"trainer.steps={STEPS}",
        f"trainer.batch_groups={BATCH}",
        "trainer.micro_batch_size=32",
        "trainer.lr=3e-3",
        "trainer.warmup_steps=0",
        "trainer.checkpoint_every=0",
        "rollout.max_new_tokens=4",
        "rollout.max_slots=32",
        "rollout.kv_token_budget=1024",
        "runtime.buffer_groups=8",
        "runtime.max_staleness=1",
        "eval.every=0",
        "task.num_eval=32",
        "task.reward_fn=e2e_rewards:first_is_digit",
        "fleet.check_every_s=0.2",
    )
    return cfg, train(cfg, live=False)


@pytest.mark.timeout(300)
def test_run_with_a_two_rank_rollout_group(ep_group_run, default_init):
    cfg, summary = ep_group_run
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["trainer_ranks"] == 2
    assert_trained_exactly_once(summary, newest_run(cfg), STEPS, BATCH)
    assert summary["fleet"]["killed"] == 0 and summary["fleet"]["spawned"] == 1
    # the worker is a group of 2 EP rank processes (its telemetry), and it did generate
    assert (
        summary["fleet"]["ep_size"] == 2 and len(set(summary["fleet"]["worker_rank_pids"]["rollout-0"])) == 2
    )
    assert read_jsonl(newest_run(cfg).metrics)[-1]["rollout/workers"]["rollout-0"]["groups_total"] > 0
    # the evals were the EP group's (the driver holds no policy): the figures of an in-process eval of the
    # starting policy and of the exported final one (issue 34)
    r = cfg.rollout
    sizes = {
        "max_new_tokens": r.max_new_tokens,
        "max_slots": r.max_slots,
        "kv_token_budget": r.kv_token_budget,
    }
    task, tokenizer = make_task(cfg.task, cfg.env), load_run_tokenizer(cfg, str(default_init))
    start = evaluate(from_pretrained(str(default_init)), tokenizer, task, **sizes).accuracy
    final = evaluate(from_pretrained(summary["policy"]), tokenizer, task, **sizes).accuracy
    assert (summary["start_eval_accuracy"], summary["final_eval_accuracy"]) == (start, final)


@pytest.mark.timeout(300)
def test_collective_weights_to_an_ep_rollout_group_learn_exactly_once(ep_group_run):
    cfg, summary = ep_group_run
    print({k: summary[k] for k in ("start_eval_accuracy", "final_eval_accuracy", "wall_time_s")})
    assert summary["status"] == "completed" and summary["mode"] == "async" and summary["steps"] == STEPS
    assert summary["trainer_ranks"] == 2 and summary["fleet"]["ep_size"] == 2
    assert_trained_exactly_once(summary, newest_run(cfg), STEPS, BATCH)
    assert summary["fleet"]["killed"] == 0 and summary["fleet"]["spawned"] == 1  # no group was lost
    assert summary["final_eval_accuracy"] >= summary["start_eval_accuracy"] + MARGIN
    # versions reached the workers by broadcast: groups were generated at versions the store never had
    # (durable_every=4: only 0, 4, 8, 12 were written)
    versions = {e.policy_version for e in newest_run(cfg).read_ledger()}
    assert any(v % 4 for v in versions), versions
    assert all(r["weights/sync_bytes"] > 0 for r in read_jsonl(newest_run(cfg).metrics))


@pytest.mark.timeout(300)
def test_a_killed_worker_loses_only_its_weight_group(local_ray, default_init, tmp_path, caplog):
    """One-process trainer (the sender is the driver), 2 one-rank workers, one SIGKILLed by chaos mid-run:
    the sender drops the lost worker's group at its next broadcast instead of hanging, the fleet
    replaces the worker, whose new group gets the broadcast versions; every task trained exactly once."""
    steps, batch = 12, 4
    cfg = run_config(
        DEFAULT_CONFIG,
        tmp_path,
        default_init,
        "runtime.mode=async",
        "runtime.weight_sync=collective",
        "runtime.durable_every=4",
        "runtime.collective_timeout_s=20",
        "rollout.num_workers=2",
        f"trainer.steps={steps}",
        f"trainer.batch_groups={batch}",
        "trainer.micro_batch_size=32",
        "trainer.checkpoint_every=0",
        "chaos.slow_worker=rollout-0",  # generation long enough for a worker to be killed while busy
        "chaos.slow_factor=0.3",
        "rollout.max_slots=8",
        "runtime.buffer_groups=8",
        "runtime.max_staleness=1",
        "runtime.lease_ttl_s=10",
        "eval.every=0",
        "task.num_eval=16",
        "task.reward_fn=e2e_rewards:first_is_digit",
        "fleet.check_every_s=0.2",
        "chaos.kill_rollout_every_s=1",
        "chaos.max_kills=1",
        "chaos.start_after_s=0.5",
    )
    summary = train(cfg, live=False)
    print(summary["fleet"])
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert_trained_exactly_once(summary, newest_run(cfg), steps, batch)
    assert summary["fleet"]["killed"] == 1 and summary["fleet"]["spawned"] == 3  # a replacement started
    assert "weight group" in caplog.text and "dropped (its worker is lost)" in caplog.text
    versions = {e.policy_version for e in newest_run(cfg).read_ledger()}
    assert any(v % 4 for v in versions), versions  # broadcast versions reached the workers
