"""examples/verl_format runs as a user runs it (issue 51): from another working folder, its config's
relative paths found beside it, verl-format parquet read as it is, the reward reading ``extra``
(``reward_model.ground_truth``, ``extra_info``), a separate validation parquet held out, and
``eval/pass@4`` in metrics.jsonl equal to the unbiased estimator recomputed from eval_samples.jsonl; in
sync mode (the CLI, a subprocess) and in async mode (Ray workers score and evaluate)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from moerl.rundir.folder import read_jsonl

pytestmark = pytest.mark.ray_group("ray_a")  # one Ray instance with test_async_eval_on_worker, test_env_runs

WORKTREE = Path(__file__).resolve().parents[2]
EXAMPLE = WORKTREE / "examples" / "verl_format" / "config.yaml"
SHORT = [
    "sft.steps=0",  # from a fresh policy (init_from): the example's own warm start takes minutes
    "trainer.steps=2",
    "trainer.batch_groups=2",
    "trainer.micro_batch_size=16",
    "trainer.checkpoint_every=0",
    "rollout.max_slots=32",
    "rollout.kv_token_budget=1024",
    "eval.every=0",  # the start and the end
]


def val_rows() -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(EXAMPLE.parent / "val.parquet").num_rows


def recomputed(samples: list[dict], k: int) -> tuple[float, float]:
    """(pass@k, mean@k) of one eval's logged samples: mean over prompts of 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, eq. 1), and the share of correct samples."""
    by_prompt: dict[str, list[float]] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_id"], []).append(s["correct"])
    estimates = [1 - math.comb(len(c) - int(sum(c)), k) / math.comb(len(c), k) for c in by_prompt.values()]
    return sum(estimates) / len(estimates), sum(map(sum, by_prompt.values())) / len(samples)


def check_run(run: Path) -> dict:
    """The run's summary, after checking its held-out set, eval metrics and logged samples."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["reward_errors"] == 0  # extra reached the reward
    last = read_jsonl(run / "metrics.jsonl")[-1]
    samples = [s for s in read_jsonl(run / "eval_samples.jsonl") if s["step"] == last["step"]]
    assert {s["set"] for s in samples} == {"val"} and {s["k"] for s in samples} == {4}
    assert len({s["prompt_id"] for s in samples}) == val_rows() and len(samples) == 8 * val_rows()  # n = 8
    pass_k, mean_k = recomputed(samples, 4)
    assert last["eval/pass@4"] == pytest.approx(pass_k) and last["eval/mean@4"] == pytest.approx(mean_k)
    assert summary["final_eval"]["eval/pass@4"] == last["eval/pass@4"]
    return summary


@pytest.mark.timeout(300)
def test_the_verl_example_runs_from_another_folder_and_reports_pass_at_4(tmp_path, default_init):
    work = tmp_path / "work"
    work.mkdir()
    sets = [f"--set={s}" for s in (*SHORT, f"init_from={default_init}", "output_dir=runs")]
    out = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "train", "--config", os.path.relpath(EXAMPLE, work), *sets],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(WORKTREE)},  # verl_reward.py only beside the config
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == f"config: {EXAMPLE}"
    assert f"200 rows: 200 train; held out: task.val_path: val ({val_rows()} rows)" in out.stderr
    (run,) = (work / "runs").iterdir()
    check_run(run)


@pytest.mark.timeout(300)
def test_the_verl_example_in_async_mode_scores_and_evaluates_on_ray_workers(
    tmp_path, default_init, shared_ray, monkeypatch
):
    from moerl.cli import _config
    from moerl.train import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders the config adds go away with the test
    overrides = [*SHORT, f"init_from={default_init}", "output_dir=runs", "runtime.mode=async"]
    cfg = _config(Namespace(config=os.path.relpath(EXAMPLE, tmp_path), overrides=overrides))
    assert cfg.task.path == str(EXAMPLE.parent / "train.parquet")
    summary = check_run(_run(train, cfg))  # the run joins the group's Ray instance (shared_ray)
    assert summary["mode"] == "async"


def _run(train, cfg) -> Path:
    train(cfg, live=False)
    (run,) = Path("runs").iterdir()
    return run.resolve()
