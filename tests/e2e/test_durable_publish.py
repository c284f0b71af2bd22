"""Issue 47 on CPU: at a ~50 M-parameter policy, the default publish keeps durable copies off the step's path
in sync and async mode, and the store still holds version 0, every ``durable_every``-th version, the
checkpoint's and the last; a store whose writes fail stops a run with one line.

Off the path is shown without timing the host: version 2's durable write is made ``SLOW_WRITE_S`` slower, and
step 2's ``timing/publish_s`` may not contain it (a publish that writes before it returns takes at least that).
The figure itself (``timing/publish_s`` per step) is printed (``pytest -s``)."""

from __future__ import annotations

import threading
import time

import pytest
from _runs import newest_run, run_config, save_fresh_policy
from conftest import TINY_MODEL, short_config

from moerl.cli import main as cli_main
from moerl.config import load_config
from moerl.rundir.folder import read_jsonl
from moerl.runtime.ray.local import ray_connected
from moerl.train import train
from moerl.weights.store import WeightStore

FIFTY_M = [
    "model.hidden_size=512",
    "model.num_layers=7",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "model.head_dim=64",
    "model.num_experts=8",
    "model.top_k=2",
    "model.moe_intermediate_size=512",
    "model.max_position_embeddings=64",
]
"""48.8 M parameters with the built-in tokenizer (float32: 195 MB a version)."""

pytestmark = pytest.mark.usefixtures("no_report_figures")  # no test here reads report.png

SLOW_WRITE_S = 4.0
"""Seconds added to version 2's durable write (on the store's writer thread)."""


@pytest.fixture(scope="module")
def init_50m(tmp_path_factory):
    """A fresh ~50 M-parameter MoE policy folder."""
    return save_fresh_policy(tmp_path_factory.mktemp("init50m") / "policy", load_config(None, FIFTY_M).model)


def _config(tmp_path, init, mode: str):
    """5 short steps with the shipped publish defaults (only durable_every, checkpoint_every and
    keep_versions set, so that the store shows which versions were written)."""
    return run_config(
        None,
        tmp_path,
        init,
        *FIFTY_M,
        f"runtime.mode={mode}",
        "trainer.steps=5",
        "trainer.batch_groups=2",
        "trainer.micro_batch_size=8",
        "rollout.group_size=2",
        "rollout.max_new_tokens=2",
        "rollout.max_slots=4",
        "rollout.kv_token_budget=256",
        "rollout.num_workers=1",
        "task.num_eval=2",
        "eval.every=0",
        "trainer.checkpoint_every=3",
        "runtime.durable_every=2",
        "runtime.keep_versions=100",  # nothing pruned: the store shows every version written
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_publish_stays_off_the_step_and_the_store_keeps_the_durable_versions(
    tmp_path, init_50m, mode, monkeypatch
):
    if mode == "async":
        pytest.importorskip("ray")
    real = WeightStore._publish_now
    written: list[tuple[int, str]] = []

    def slow(self, version, tensors, max_shard_bytes):
        if version == 2:
            time.sleep(SLOW_WRITE_S)
        written.append((version, threading.current_thread().name))
        return real(self, version, tensors, max_shard_bytes)

    monkeypatch.setattr(WeightStore, "_publish_now", slow)
    cfg = _config(tmp_path, init_50m, mode)
    summary = train(cfg, live=False)
    run = newest_run(cfg)
    rows = read_jsonl(run.metrics)
    publish_s = [r["timing/publish_s"] for r in rows]
    assert summary["steps"] == 5 and len(publish_s) == 5
    print(f"{mode}: timing/publish_s per step {[round(x, 4) for x in publish_s]}, writes {written}")
    # versions 2, 3 (the checkpoint's), 4 and 5 (the last) were handed to the writer at their publish; version
    # 2's write takes SLOW_WRITE_S more: a publish that wrote it before returning would take at least that
    # (step 4's hand-over may wait for it: at most 2 versions are pending, memory stays bounded)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and publish_s[1] < SLOW_WRITE_S, publish_s
    later = [name for v, name in written if v >= 1]
    assert later and all(name.startswith("moerl-weight-store") for name in later), written
    # version 0, every 2nd, the checkpoint's (3) and the last (5); 1 never
    assert WeightStore(str(run.weights)).versions() == [0, 2, 3, 4, 5]
    startup = summary["startup_s"]
    if mode == "async":  # the rollout side's start milestones, in the order they happen
        at = [startup[k] for k in ("ray_started", "workers_spawned", "exchange_ready", "rollouts_started")]
        assert at == sorted(at) and at[-1] <= startup["first_step"], startup
        # the run shut down the Ray instance it started: the next run here starts its own (CI once
        # reused this one in a later test, whose workers lacked that test's PYTHONPATH)
        assert not ray_connected()


def test_a_store_whose_background_writes_fail_stops_the_run_with_one_line(
    tmp_path, tiny_init, monkeypatch, capsys
):
    real = WeightStore._publish_now

    def failing(self, version, tensors, max_shard_bytes):
        if version >= 2:
            raise OSError("injected: the bucket refused the write")
        return real(self, version, tensors, max_shard_bytes)

    monkeypatch.setattr(WeightStore, "_publish_now", failing)
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: built-in defaults, as short_config
    cfg = short_config(tmp_path, tiny_init, "trainer.steps=6", "runtime.durable_every=1")
    overrides = [f"output_dir={tmp_path}", f"init_from={tiny_init}", *TINY_MODEL, "runtime.mode=sync"]
    overrides += ["trainer.steps=6", "trainer.batch_groups=2", "rollout.group_size=4"]
    overrides += ["rollout.max_new_tokens=4", "rollout.max_slots=8", "rollout.kv_token_budget=512"]
    overrides += ["task.num_eval=16", "eval.every=0", "trainer.checkpoint_every=0", "runtime.durable_every=1"]
    code = cli_main(["train", *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    failed = [line for line in err if "background write" in line]  # the console lines before it: the run's
    assert len(failed) == 1 and failed[0] == err[-1] and err[-1].startswith("moerl: weight store:"), err
    assert "version 2" in err[-1] and "bucket refused the write" in err[-1], err
    run = newest_run(cfg)
    assert len(read_jsonl(run.metrics)) < 6  # stopped at the next step, not at the end
    assert WeightStore(str(run.weights)).versions() == [0, 1]  # what was committed stays whole
