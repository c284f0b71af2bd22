"""``FollowerWeights``: an EP follower takes the version its leader names from the forwarded buckets,
else from the weight store, and fails clearly when neither has it."""

from __future__ import annotations

import pytest
import torch

from moerl.runtime.ray.ep_group import FollowerWeights
from moerl.weights.buckets import BucketAssembler, iter_packed
from moerl.weights.store import WeightStore


def _tensors(v: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3,), float(v)), "b": torch.arange(4.0) + v}


def _offer(asm: BucketAssembler, version: int) -> None:
    for b in iter_packed(version, _tensors(version), 16):
        asm.offer(version, b.index, b.num_buckets, b)


def test_version_from_buckets_even_when_a_newer_one_completed_first(tmp_path):
    asm = BucketAssembler(lambda ref: ref, background=False)
    weights = FollowerWeights(asm, WeightStore(str(tmp_path / "w")), weight_wait_s=0.2)
    _offer(asm, 1)
    weights._take_complete()  # version 1 is kept while version 2 arrives
    _offer(asm, 2)
    got = weights.load(1)
    assert torch.equal(got["a"], _tensors(1)["a"]) and torch.equal(got["b"], _tensors(1)["b"])
    assert torch.equal(weights.load(2)["b"], _tensors(2)["b"])


def test_version_from_the_store_then_missing_is_an_error(tmp_path):
    store = WeightStore(str(tmp_path / "w"))
    store.publish(0, _tensors(0))
    weights = FollowerWeights(BucketAssembler(lambda ref: ref, background=False), store, weight_wait_s=0.2)
    assert torch.equal(weights.load(0)["a"], _tensors(0)["a"])
    with pytest.raises(
        RuntimeError, match="policy version 5 did not arrive within 0 s and is not in the weight store"
    ):
        weights.load(5)
