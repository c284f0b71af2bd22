"""The sharded trainer (FSDP2 x EP over gloo, float32) equals the one-rank Trainer step for step."""

from __future__ import annotations

import pytest
import torch
import trainer_cases
from dist_harness import run_world

LAYOUTS = [  # (num_ranks, ep_size, dispatcher, gpus_per_node, trainer overrides)
    (2, 2, "alltoall", 8, {}),
    (4, 2, "alltoall", 8, {}),  # two data-parallel replicas of each EP shard
    (4, 4, "hierarchical", 2, {}),  # 2 simulated nodes x 2
    (2, 1, "alltoall", 8, {"activation_checkpointing": True}),  # FSDP2 only, layers recomputed
]


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    trainer_cases.save_policy(folder)
    return folder, trainer_cases.reference(folder)


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda x: "R{}-EP{}-{}-G{}".format(*x[:4]) + ("-ac" if x[4] else "")
)
def test_sharded_steps_and_weights_equal_one_rank(policy, layout):
    folder, ref = policy
    world, ep_size, dispatcher, gpus_per_node, overrides = layout
    results = run_world(
        trainer_cases.run_sharded,
        world,
        str(folder),
        ep_size,
        dispatcher,
        gpus_per_node,
        overrides,
        preload=("trainer_cases",),
    )
    for res in results:  # every rank reports the global step values
        for key in ("pg_loss", "grad_norm"):
            errors = [_rel(g, w) for g, w in zip(res[key], ref[key], strict=True)]
            print(f"{layout}: {key} max relative error {max(errors):.2e}")
            assert max(errors) <= 1e-5, f"{key}: {res[key]} vs one rank {ref[key]}"
        assert res["local_numel"] < res["full_numel"] / world * 1.5  # a shard, not the whole model
    weights = results[0]["weights"]
    assert weights.keys() == ref["weights"].keys()
    errors = {
        name: float((weights[name] - want).abs().max()) / float(want.abs().max())
        for name, want in ref["weights"].items()
    }
    print(f"{layout}: weights max relative error {max(errors.values()):.2e}")
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    assert not bad, f"relative errors above 1e-5: {bad}"
    published = results[0]["published"]  # bucketed publish: the WeightStore format readers use
    assert results[0]["num_files"] > 1 and published.keys() == weights.keys()
    assert all(torch.equal(published[k], w) for k, w in weights.items())
    moved = max(float((ref["weights"][n] - w).abs().max()) for n, w in weights.items())
    assert moved > 0


def test_sharded_activation_checkpointing_recomputes_every_layer_in_backward(policy):
    """2 ranks (FSDP2): with ``activation_checkpointing`` every decoder layer runs again inside backward,
    once per gradient-enabled forward; without it none does (the equal-values layout above cannot tell)."""
    folder, _ = policy
    calls = {
        ac: run_world(
            trainer_cases.layer_calls,
            2,
            str(folder),
            {"activation_checkpointing": ac},
            preload=("trainer_cases",),
        )
        for ac in (False, True)
    }
    for rank in range(2):
        off, on = calls[False][rank], calls[True][rank]
        layers = range(trainer_cases.MODEL.num_layers)
        assert all(off["forward"].get(i, 0) > 0 for i in layers), off
        assert not off["backward"], off
        assert on["forward"] == off["forward"]
        assert all(on["backward"].get(i, 0) == on["forward"][i] for i in layers), on
