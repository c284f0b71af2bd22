"""``moerl train`` (sync, float32, gloo) with a sharded trainer gives the one-rank run's steps and weights.

Layouts: 2 ranks EP 2; 4 ranks EP 2 (two data-parallel replicas); 4 ranks EP 4 with the hierarchical
dispatcher over 2 simulated nodes. 5 steps each: train/pg_loss and train/grad_norm of every step and
the weights published after the last step equal the one-rank run within 1e-5 relative. A 4-rank run's
sharded checkpoint (step 3) resumed at 2 ranks and at 1 rank continues like the uninterrupted runs.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import train_cases

from moerl.models import from_pretrained
from moerl.rundir.folder import read_jsonl
from moerl.train import resume
from moerl.weights.store import WeightStore

pytestmark = pytest.mark.usefixtures("no_report_figures")  # no test here reads report.png

LAYOUTS = {
    "R2-EP2": ["trainer.num_ranks=2", "trainer.ep_size=2"],
    "R4-EP2": ["trainer.num_ranks=4", "trainer.ep_size=2"],
    "R4-EP4-hier": [
        "trainer.num_ranks=4",
        "trainer.ep_size=4",
        "trainer.ep_dispatcher=hierarchical",
        "trainer.gpus_per_node=2",
    ],
}


def _rel(got: float, want: float, floor: float) -> float:
    """|got - want| / max(|want|, floor): relative, except for a value that is itself a cancellation to
    near 0 (a step whose advantages sum to ~0 over its tokens has a pg_loss of float noise, ~1e-8)."""
    return abs(got - want) / max(abs(want), floor, 1e-30)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_runs")
    init = train_cases.warm_start(root / "init")
    return root, init, train_cases.run(train_cases.run_config(root, init, "one", "trainer.num_ranks=1"))


_RUNS: dict[str, dict] = {}


def _layout_run(one_rank, layout: str) -> dict:
    root, init, _ = one_rank
    if layout not in _RUNS:
        _RUNS[layout] = train_cases.run(train_cases.run_config(root, init, layout, *LAYOUTS[layout]))
    return _RUNS[layout]


def _assert_same_run(got_metrics, got_weights, ref, label: str) -> None:
    for key in ("train/pg_loss", "train/grad_norm"):
        floor = 0.1 * max(abs(m[key]) for m in ref["metrics"])  # 10% of the run's largest |value|
        errors = [_rel(g[key], w[key], floor) for g, w in zip(got_metrics, ref["metrics"], strict=True)]
        print(f"{label}: {key} max relative error {max(errors):.2e}")
        assert max(errors) <= 1e-5, (
            f"{key}: {[m[key] for m in got_metrics]} vs {[m[key] for m in ref['metrics']]}"
        )
    errors = {
        k: float((got_weights[k] - w).abs().max()) / float(w.abs().max()) for k, w in ref["weights"].items()
    }
    print(f"{label}: published weights max relative error {max(errors.values()):.2e}")
    assert got_weights.keys() == ref["weights"].keys()
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_run_equals_one_rank(one_rank, layout):
    root, init, ref = one_rank
    got = _layout_run(one_rank, layout)
    assert got["summary"]["tasks_duplicated"] == got["summary"]["tasks_lost"] == 0
    assert len(got["metrics"]) == len(ref["metrics"]) == 5
    assert sum(abs(m["train/pg_loss"]) > 1e-3 for m in ref["metrics"]) >= 2  # a real loss, not float noise
    assert got["version"] == ref["version"] == 5
    _assert_same_run(got["metrics"], got["weights"], ref, layout)
    # the exported policy/ (streamed from the shards) loads as a Hugging Face folder with the same weights
    exported = from_pretrained(got["folder"] / "policy").state_dict()
    assert (got["folder"] / "policy" / "tokenizer.json").is_file()
    assert exported.keys() == got["weights"].keys()
    assert all(torch.equal(exported[k], w) for k, w in got["weights"].items())


@pytest.mark.parametrize("num_ranks", [2, 1])
def test_a_4_rank_checkpoint_resumes_at_fewer_ranks(one_rank, tmp_path, num_ranks):
    """Stopped after its step-3 checkpoint (a copy of the finished run without its summary), the 4-rank run
    resumes at 2 ranks (EP 2) or at 1 and ends like the uninterrupted run at that size."""
    four = _layout_run(one_rank, "R4-EP2")
    assert (four["folder"] / "checkpoints" / "shards" / "step_3" / ".metadata").is_file()
    stopped = tmp_path / "stopped"
    shutil.copytree(four["folder"], stopped)
    (stopped / "summary.json").unlink()
    overrides = (
        ["trainer.num_ranks=2", "trainer.ep_size=2"]
        if num_ranks == 2
        else ["trainer.num_ranks=1", "trainer.ep_size=1"]
    )
    summary = resume(stopped, overrides, live=False)
    assert summary["steps"] == 5 and summary["tasks_duplicated"] == summary["tasks_lost"] == 0
    ref = _layout_run(one_rank, "R2-EP2") if num_ranks == 2 else one_rank[2]
    weights = WeightStore(str(stopped / "weights")).load_latest()[1]
    _assert_same_run(read_jsonl(stopped / "metrics.jsonl"), weights, ref, f"R4 -> resume at {num_ranks}")
