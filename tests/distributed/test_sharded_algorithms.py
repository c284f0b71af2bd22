"""Reference KL, PPO's critic, R3 routing replay and the aux loss on the sharded trainer (FSDP2 x EP over
gloo, float32) equal the one-rank Trainer: losses, every logged algorithm figure (global-batch means),
updated policy weights and critic weights."""

from __future__ import annotations

import math

import algo_cases
import pytest
import trainer_cases
from dist_harness import run_world

NAMES = list(algo_cases.CASES)
LAYOUTS = [(2, 1), (2, 2)]  # (num_ranks, ep_size): FSDP2 only; FSDP2 x EP


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    trainer_cases.save_policy(folder)
    return folder, {name: algo_cases.reference(folder, name) for name in NAMES}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda x: "R{}-EP{}".format(*x))
def sharded(request, policy):
    folder, _ = policy
    world, ep_size = request.param
    results = run_world(
        algo_cases.run_sharded, world, str(folder), ep_size, NAMES, preload=("trainer_cases", "algo_cases")
    )
    return request.param, results


def _close(got: float, want: float, rel: float = 1e-5, abs_: float = 1e-7) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= max(rel * abs(want), abs_)


def _max_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[k] - w).abs().max()) / max(float(w.abs().max()), 1e-12) for k, w in want.items())


@pytest.mark.parametrize("name", NAMES)
def test_sharded_algorithm_step_equals_one_rank(policy, sharded, name):
    _, refs = policy
    layout, results = sharded
    ref = refs[name]
    for rank, res in enumerate(results):  # every rank logs the global figures
        for step, (got, want) in enumerate(zip(res[name]["steps"], ref["steps"], strict=True)):
            bad = {k: (got[k], w) for k, w in want.items() if not _close(got[k], w)}
            assert not bad, f"{layout} {name} rank {rank} step {step + 1}: (R ranks, one rank) {bad}"
    err = _max_rel(results[0][name]["weights"], ref["weights"])
    print(f"{layout} {name}: policy weights max relative error {err:.1e}")
    assert err <= 1e-5
    if ref["critic"] is not None:
        err = _max_rel(results[0][name]["critic"], ref["critic"])
        print(f"{layout} {name}: critic weights max relative error {err:.1e}")
        assert err <= 1e-5
    want = ref["steps"][0]
    if name.startswith("kl"):
        assert abs(want["algo/kl_ref"]) < 1e-12 < abs(ref["steps"][1]["algo/kl_ref"])  # reference in use
    if name.startswith("ppo"):
        assert not math.isnan(want["algo/value_loss"]) and not math.isnan(want["algo/value_explained_var"])
    if name == "r3":  # the recorded experts were replayed: other expert loads than the router's own
        assert want["algo/expert_load_max_min"] != refs["kl"]["steps"][0]["algo/expert_load_max_min"]
    assert want["algo/is_weight_mean"] < 0.9  # random behaviour log-probs: the correction is in use
