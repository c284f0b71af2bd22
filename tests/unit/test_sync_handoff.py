"""Sync mode's in-process weight hand-off (``LocalRollouts.publish``): the engine gets the trainer's
tensors by reference and copies them tensor to tensor; the serialized store write happens only every
``runtime.durable_every`` versions and at the last one."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from moerl.config import load_config
from moerl.models import build_model
from moerl.runtime.build import make_engine
from moerl.runtime.local import LocalRollouts
from moerl.weights.sources import LocalWeights
from moerl.weights.store import WeightStore


class ModelTrainer:
    """The ``WeightHolder`` ``publish`` asks, over a real policy: a version, its tensors, a store write."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.version, self.published = model, 0, []

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2)
        self.version += 1

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def publish(self, store: WeightStore):
        self.published.append(self.version)
        return store.publish(self.version, self.named_weights())


def _rollouts(store, durable_every):
    buffer = SimpleNamespace(set_version=lambda v: setattr(buffer, "version", v))
    worker = SimpleNamespace(
        stats=SimpleNamespace(weight_updates=0, last_weight_load_s=None, tokens_resumed=0, tokens_discarded=0)
    )
    return LocalRollouts(None, buffer, worker, LocalWeights(), store, durable_every=durable_every)


def test_sync_publish_serializes_only_the_due_versions_and_the_last(tmp_path):
    torch.manual_seed(0)
    cfg = load_config(None, [])
    trainer = ModelTrainer(build_model(cfg.model, 32))
    store = WeightStore(str(tmp_path / "weights"), keep=10)
    rollouts = _rollouts(store, durable_every=3)
    at = {}  # version -> the trainer's weights then
    for v in range(1, 6):
        store.writer.copies.wait()  # the run's fence before the optimizer step (host copies taken)
        trainer.step(v)
        at[v] = {k: t.clone() for k, t in trainer.named_weights().items()}
        rollouts.publish(trainer, is_final=v == 5)
        version, tensors = rollouts.weights.poll(v - 1)
        assert version == v and rollouts.buffer.version == v
        for name, t in trainer.named_weights().items():  # references: no copy, no bytes
            assert tensors[name].data_ptr() == t.data_ptr()
        assert isinstance(rollouts.fleet_values(1)["timing/weight_sync_s"], float)
    # written from host snapshots on the store's writer thread (not the trainer's foreground publish),
    # each the weights of its own version though the trainer stepped on in place meanwhile
    assert trainer.published == [] and store.versions() == [3, 5]
    for v in (3, 5):
        stored = store.load(v)
        assert all(torch.equal(stored[k], t) for k, t in at[v].items()), v


def test_in_process_swap_gives_the_engine_exactly_the_stored_path_weights(tmp_path):
    torch.manual_seed(1)
    cfg = load_config(None, [])
    trainer = ModelTrainer(build_model(cfg.model, 32))
    swapped, loaded = (
        make_engine(copy.deepcopy(trainer.model), cfg),
        make_engine(copy.deepcopy(trainer.model), cfg),
    )
    store = WeightStore(str(tmp_path / "weights"), keep=3)
    rollouts = _rollouts(store, durable_every=1)  # every version also takes the old, serialized path
    for v in (1, 2):
        trainer.step(10 + v)
        rollouts.publish(trainer)
        version, tensors = rollouts.weights.poll(swapped.version)
        swapped.update_weights(tensors, version)
        stored, stored_tensors = store.load_latest()
        loaded.update_weights(stored_tensors, stored.version)
    want = trainer.model.state_dict()
    got_a, got_b = swapped.model.state_dict(), loaded.model.state_dict()
    assert swapped.version == loaded.version == 2
    assert set(got_a) == set(want)
    for name, t in want.items():
        assert torch.equal(got_a[name], t) and torch.equal(got_b[name], t), name
        assert got_a[name].data_ptr() != t.data_ptr()  # the engine's own copy: training does not change it
