"""The weight transport registry (moerl.weights.transport): the config's choices and checks come from it,
and the collective transport moves a trainer's versions to a worker opened from its receiver spec, the
store written every durable_every versions and at the end (no Ray: a fake one-process trainer)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from moerl.config import ConfigError, load_config
from moerl.weights.store import WeightStore
from moerl.weights.transport import TRANSPORTS, make_transport
from moerl.weights.transports import stream_named


def test_the_config_choices_are_the_registry():
    assert set(TRANSPORTS) == {"object_store", "collective", "cuda_ipc", "store"}
    for name in TRANSPORTS:
        assert load_config(None, [f"runtime.weight_sync={name}"]).runtime.weight_sync == name
    with pytest.raises(ConfigError, match="runtime.weight_sync"):
        load_config(None, ["runtime.weight_sync=nccl_magic"])


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["runtime.weight_sync=cuda_ipc", "trainer.num_ranks=2"], "needs one trainer process"),
        (["runtime.weight_sync=cuda_ipc", "runtime.mode=async", "rollout.ep_size=2"], "EP group"),
        (
            [
                "runtime.weight_sync=collective",
                "runtime.mode=async",
                "rollout.ep_size=2",
                "trainer.num_ranks=2",
            ],
            None,
        ),
        (["runtime.weight_sync=store", "runtime.mode=async", "rollout.ep_size=2"], None),
        (["runtime.collective_timeout_s=0"], "collective_timeout_s"),
    ],
)
def test_each_transport_checks_what_it_serves(overrides, error):
    if error is None:
        load_config(None, overrides)
    else:
        with pytest.raises(ConfigError, match=error):
            load_config(None, overrides)


class FakeTrainer:
    """The ``WeightHolder`` a transport asks: a version, its tensors, a store write."""

    def __init__(self):
        self.version, self.published = 0, []
        self.weights = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}

    def step(self):
        self.version += 1
        for t in self.weights.values():
            t.add_(1.0)

    def named_weights(self):
        return self.weights

    def publish(self, store):
        self.published.append(self.version)
        return store.publish(self.version, self.weights)

    def stream_buckets(self, sink, bucket_bytes):
        return stream_named(self.version, self.weights, bucket_bytes, sink)


def test_collective_transport_moves_versions_and_writes_the_store_when_due(tmp_path):
    runtime = load_config(
        None, ["runtime.weight_sync=collective", "runtime.durable_every=2", "runtime.publish_bucket_mb=0.01"]
    ).runtime
    store = WeightStore(str(tmp_path / "weights"), keep=5)
    transport = make_transport(runtime, store)
    trainer = FakeTrainer()
    receiver = transport.receiver_spec().for_worker(1).open(fallback=None, device="cpu")
    try:
        for _ in range(3):
            store.writer.copies.wait()  # the run's fence before the optimizer step (host copies taken)
            trainer.step()
            report = transport.publish(trainer, workers=[object()])
            assert report.version == trainer.version and report.num_buckets > 1
            deadline, got = time.monotonic() + 20, None
            while got is None:
                assert time.monotonic() < deadline, f"version {trainer.version} did not arrive"
                got = receiver.poll(trainer.version - 1)
                time.sleep(0.01)
            assert got[0] == trainer.version and torch.equal(got[1]["w"], trainer.weights["w"])
        # durable_every=2: version 2 from a host snapshot on the store's writer thread, not the trainer's
        # own (foreground) publish; the copy taken at the publish, not the tensors stepped on since
        assert trainer.published == [] and store.versions() == [2]
        assert torch.equal(store.load(2)["w"], torch.full((64, 64), 2.0))
        transport.finish(trainer)  # the last version (3) goes to the store
        assert trainer.published == [3] and store.latest().version == 3
    finally:
        receiver.close()
        transport.close()


def test_sync_mode_hands_weights_over_in_process(tmp_path):
    from moerl.runtime.local import LocalRollouts
    from moerl.weights.sources import LocalWeights

    store = WeightStore(str(tmp_path / "weights"))
    buffer = SimpleNamespace(set_version=lambda v: setattr(buffer, "version", v))
    rollouts = LocalRollouts(None, buffer, None, LocalWeights(), store)
    trainer = FakeTrainer()
    trainer.step()
    rollouts.publish(trainer)
    assert rollouts.weights.poll(0)[0] == 1 and buffer.version == 1 and store.latest().version == 1
    trainer.step()
    rollouts.publish(trainer, is_stored=True)  # written by the caller: not again
    assert rollouts.weights.poll(1)[0] == 2 and store.versions() == [1]
    assert trainer.published == []  # the store's background writer wrote version 1


def test_a_version_that_is_not_the_engines_parameter_set_is_refused_and_logged_once(caplog):
    from moerl.weights.sources import CheckedWeights, LocalWeights, parameter_set

    model = torch.nn.Linear(4, 3)
    inner = LocalWeights()
    checked = CheckedWeights(inner, parameter_set(model))
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bad_versions = [
        {**good, "weight": torch.zeros(3, 5)},  # a shape
        {**good, "bias": torch.zeros(3, dtype=torch.float64)},  # a dtype
        {"weight": good["weight"]},  # a name missing
        {**good, "extra": torch.zeros(1)},  # an unknown name
    ]
    for version, tensors in enumerate(bad_versions, start=1):
        inner.push(version, tensors)
        assert checked.poll(version - 1) is None
        assert checked.poll(version - 1) is None  # polled again: still refused, counted once
    assert checked.refused_versions == 4
    assert caplog.text.count("refused") == 1 and "weight: torch.float32 (3, 5)" in caplog.text
    inner.push(5, good)
    assert checked.poll(0)[0] == 5
