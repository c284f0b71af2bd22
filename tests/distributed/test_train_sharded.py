"""``moerl train`` (sync, float32, gloo) with a sharded trainer gives the one-rank run's steps and weights.

Layouts: 2 ranks EP 2; 4 ranks EP 2 (two data-parallel replicas); 4 ranks EP 4 with the hierarchical
dispatcher over 2 simulated nodes. 5 steps each: train/pg_loss and train/grad_norm of every step and
the weights published after the last step equal the one-rank run within 1e-5 relative.
"""

from __future__ import annotations

import pytest
import train_cases

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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_run_equals_one_rank(one_rank, layout):
    root, init, ref = one_rank
    got = train_cases.run(train_cases.run_config(root, init, layout, *LAYOUTS[layout]))
    assert got["summary"]["tasks_duplicated"] == got["summary"]["tasks_lost"] == 0
    assert len(got["metrics"]) == len(ref["metrics"]) == 5
    assert sum(abs(m["train/pg_loss"]) > 1e-3 for m in ref["metrics"]) >= 2  # a real loss, not float noise
    for key in ("train/pg_loss", "train/grad_norm"):
        floor = 0.1 * max(abs(m[key]) for m in ref["metrics"])  # 10% of the run's largest |value|
        errors = [_rel(g[key], w[key], floor) for g, w in zip(got["metrics"], ref["metrics"], strict=True)]
        print(f"{layout}: {key} max relative error {max(errors):.2e}")
        assert max(errors) <= 1e-5, (
            f"{key}: {[m[key] for m in got['metrics']]} vs {[m[key] for m in ref['metrics']]}"
        )
    assert got["version"] == ref["version"] == 5
    errors = {
        k: float((got["weights"][k] - w).abs().max()) / float(w.abs().max())
        for k, w in ref["weights"].items()
    }
    print(f"{layout}: published weights max relative error {max(errors.values()):.2e}")
    assert got["weights"].keys() == ref["weights"].keys()
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
