"""runtime.weight_sync=object_store from a trainer group: the 2-rank FSDP2 x EP trainer (gloo) streams
its version bucket by bucket from rank 0, and a worker's assembled version equals the one-rank weights."""

from __future__ import annotations

import torch
import trainer_cases
from dist_harness import run_world

from moerl.models import from_pretrained


def test_streamed_version_equals_one_rank_trainer(tmp_path):
    trainer_cases.save_policy(tmp_path)
    ref = trainer_cases.reference(tmp_path)["weights"]
    results = run_world(
        trainer_cases.run_streamed, 2, str(tmp_path), 2, 16 * 1024, preload=("trainer_cases",)
    )
    assert results[1]["streamed"] is None  # only rank 0 sends
    r0 = results[0]
    streamed = r0["streamed"]
    assert streamed.version == 5 and len(streamed.refs) > 1  # small buckets: several
    assert r0["version"] == 5
    assembled = r0["assembled"]
    assert assembled.keys() == ref.keys()
    assert streamed.nbytes >= sum(t.numel() * t.element_size() for t in ref.values())
    for name, got in assembled.items():
        assert torch.equal(got, r0["gathered"][name]), name  # exactly the gathered full tensor
        rel = float((got - ref[name]).abs().max()) / float(ref[name].abs().max())
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e} vs the one-rank trainer"
    start = from_pretrained(tmp_path).state_dict()  # the 5 steps moved the weights: a real version
    assert max(float((start[n] - w).abs().max()) for n, w in assembled.items()) > 1e-6
