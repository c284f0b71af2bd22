"""The Qwen3-MoE model with EP = 4 over gloo (2 nodes x 2) gives the EP = 1 logits, loss and gradients."""

from __future__ import annotations

import ep_model_cases
from dist_harness import run_world


def test_ep4_model_matches_ep1():
    results = run_world(ep_model_cases.run_model_case, 4, 2, preload=("ep_model_cases",))
    for rank, res in enumerate(results):
        for disp in ("alltoall", "hierarchical"):
            assert res[f"{disp}_sharded"] == 2, "both MoE layers must be sharded"
            errors = res[disp]
            assert any(k.endswith("experts.gate_up_proj") for k in errors)
            assert any(k.endswith("router.weight") for k in errors)
            bad = {k: v for k, v in errors.items() if not v <= 1e-5}
            assert not bad, f"rank {rank}, {disp}: relative errors above 1e-5: {bad}"
