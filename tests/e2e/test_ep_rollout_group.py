"""EP rollout worker groups in async runs (rollout.ep_size=2, trainer.num_ranks=2), configs/default.yaml shortened.

- The run completes; every task is trained exactly once; the worker reports its 2 EP ranks.
- One follower rank process SIGKILLed by pid mid-run: the group's worker ends as crashed, a new group
  replaces it, and still nothing is lost or trained twice.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.models import build_model, save_pretrained
from moerl.runtime.run_dir import RunDir, read_jsonl
from moerl.tasks import load_tokenizer
from moerl.train import train

ray = pytest.importorskip("ray")

E2E_DIR = Path(__file__).parent
DEFAULT_CONFIG = Path(__file__).parents[2] / "configs" / "default.yaml"
BATCH = 4


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module; workers find ``e2e_rewards`` through PYTHONPATH."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(E2E_DIR), old) if p)
    ray.init(num_cpus=6, include_dashboard=False, configure_logging=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def default_init(tmp_path_factory):
    """A fresh policy of the default config's shape (8 experts) as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("epgroup") / "policy"
    tok = load_tokenizer(None)
    torch.manual_seed(0)
    save_pretrained(build_model(load_config(DEFAULT_CONFIG).model, tok.vocab_size), path)
    tok.save(path)
    return path


def _config(out: Path, init: Path, steps: int, *overrides: str):
    return load_config(
        DEFAULT_CONFIG,
        [
            f"output_dir={out}",
            f"init_from={init}",
            "runtime.mode=async",
            "rollout.num_workers=1",
            "rollout.ep_size=2",
            "trainer.num_ranks=2",
            f"trainer.steps={steps}",
            f"trainer.batch_groups={BATCH}",
            "trainer.micro_batch_size=32",
            "trainer.checkpoint_every=0",
            "rollout.max_new_tokens=4",
            "rollout.max_slots=8",
            "rollout.kv_token_budget=512",
            "runtime.buffer_groups=8",
            "runtime.lease_ttl_s=10",
            "eval.every=0",
            "task.num_eval=16",
            "task.reward_fn=e2e_rewards:first_is_digit",
            "fleet.check_every_s=0.2",
            *overrides,
        ],
    )


def _run_dir(out: Path) -> RunDir:
    return RunDir(max(out.glob("default-*"), key=lambda p: p.stat().st_mtime))


def _assert_exactly_once(summary: dict, run: RunDir, steps: int) -> None:
    counts = Counter(e.task_id for e in run.read_ledger())
    assert len(counts) == steps * BATCH and set(counts.values()) == {1}  # each trained id once
    assert summary["tasks_trained"] == steps * BATCH
    assert summary["tasks_duplicated"] == 0 and summary["tasks_lost"] == 0
    assert [r["step"] for r in read_jsonl(run.metrics)] == list(range(1, steps + 1))


@pytest.mark.timeout(240)
def test_run_with_a_two_rank_rollout_group(local_ray, default_init, tmp_path):
    steps = 4
    summary = train(_config(tmp_path, default_init, steps), live=False)
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["trainer_ranks"] == 2
    _assert_exactly_once(summary, _run_dir(tmp_path), steps)
    assert summary["fleet"]["killed"] == 0 and summary["fleet"]["spawned"] == 1
    # the worker is a group of 2 EP rank processes (its telemetry), and it did generate
    assert (
        summary["fleet"]["ep_size"] == 2 and len(set(summary["fleet"]["worker_rank_pids"]["rollout-0"])) == 2
    )
    assert read_jsonl(_run_dir(tmp_path).metrics)[-1]["rollout/workers"]["rollout-0"]["groups_total"] > 0


def _kill_follower_mid_run(out: Path, killed: list[int], seen: list[dict]) -> None:
    """Once the run has trained 2 steps: note rank 1's engine state, then SIGKILL it by its pid."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = list(out.glob("default-*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= 2:
            names = [n for n in ray.util.list_named_actors() if n.startswith("rollout-0-ep1-")]
            if names:
                follower = ray.get_actor(names[0])
                seen.append(ray.get(follower.ep_state.remote()))
                pid = ray.get(follower.pid.remote())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.1)


def _expert_bytes(cfg) -> int:
    model = build_model(cfg.model, load_tokenizer(None).vocab_size)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@pytest.mark.timeout(240)
def test_killed_follower_rank_loses_the_worker_not_a_task(local_ray, default_init, tmp_path):
    steps = 8
    killed: list[int] = []
    seen: list[dict] = []
    killer = threading.Thread(target=_kill_follower_mid_run, args=(tmp_path, killed, seen), daemon=True)
    killer.start()
    cfg = _config(tmp_path, default_init, steps)
    summary = train(cfg, live=False)
    killer.join(5)
    assert len(killed) == 1, "the follower was not killed mid-run"
    # before the kill, the follower ran newer weights than version 0 and held half of the experts
    assert seen[0]["version"] >= 1 and seen[0]["expert_bytes"] * 2 == _expert_bytes(cfg), seen
    assert summary["status"] == "completed" and summary["steps"] == steps
    _assert_exactly_once(summary, _run_dir(tmp_path), steps)
    fleet = summary["fleet"]
    assert fleet["killed"] == 1 and fleet["replaced"] == 1 and fleet["spawned"] == 2, fleet
    assert killed[0] == fleet["worker_rank_pids"]["rollout-0"][1]  # EP rank 1 of the first group
    assert fleet["worker_rank_pids"]["rollout-1"][1] != killed[0]  # the new group has its own ranks
    with pytest.raises(ProcessLookupError):  # the killed rank is gone ...
        os.kill(killed[0], 0)
    # ... and so is its whole group: no rank of rollout-0 is left, rollout-1's ranks ended with the run
    assert not [n for n in ray.util.list_named_actors() if n.startswith(("rollout-0-", "rollout-1-"))]
