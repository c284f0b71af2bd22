"""Both rollout sides implement the declared ``Rollouts`` interface with the same signatures."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from moerl.config import load_config
from moerl.models import build_model
from moerl.placement import IN_DRIVER, RAY_ACTORS, Placement
from moerl.runtime.local import LocalRollouts
from moerl.runtime.ray import RayRollouts
from moerl.runtime.rollouts import Rollouts
from moerl.runtime.start import ROLLOUT_SIDES, RolloutsStart, start_rollouts
from moerl.weights.sources import LocalWeights

METHODS = [name for name, _ in inspect.getmembers(Rollouts, inspect.isfunction) if not name.startswith("_")]


def test_the_protocol_declares_what_the_run_calls():
    assert {
        "next_groups",
        "publish",
        "requeue",
        "worker_stats",
        "state_dict",
        "final_state",
        "close",
        "evaluate",
        "published_version",
        "precision_gap",
        "engine_model",
    } <= set(METHODS)


@pytest.mark.parametrize("impl", [LocalRollouts, RayRollouts])
def test_each_implementation_has_every_method_with_the_protocol_signature(impl):
    for name in METHODS:
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        declared = list(inspect.signature(getattr(Rollouts, name)).parameters)
        actual = list(inspect.signature(getattr(impl, name)).parameters)
        assert actual == declared, f"{impl.__name__}.{name}{actual} != Rollouts.{name}{declared}"


# -- what the run used to branch on, now asked of the rollout side ----------------------------------------


class RecordingTrainer:
    """A trainer stand-in: its version, its model, and the calls the rollouts make to it."""

    def __init__(self, version: int, model=None):
        self.version, self.model, self.calls = version, model, []

    def refresh_model(self) -> None:
        self.calls.append("refresh_model")


def test_in_process_evaluation_refreshes_the_drivers_copy_first():
    calls = []
    trainer = RecordingTrainer(3)
    rollouts = LocalRollouts(
        None,
        None,
        None,
        LocalWeights(),
        evaluator=lambda p: calls.append(("eval", p, list(trainer.calls))) or "R",
    )
    assert rollouts.evaluate(trainer, ["p"]) == "R"
    assert calls == [("eval", ["p"], ["refresh_model"])]  # refreshed before the eval saw the copy
    with pytest.raises(RuntimeError, match="no evaluator"):
        LocalRollouts(None, None, None, LocalWeights()).evaluate(trainer, None)


def test_ray_evaluation_publishes_a_version_the_workers_lack_once():
    r = object.__new__(RayRollouts)  # no Ray instance: publish and the worker eval are stand-ins
    r._version, published, asked = 2, [], []
    r.publish = lambda trainer: (published.append(trainer.version), setattr(r, "_version", trainer.version))
    r.evaluate_version = lambda prompts, version: asked.append(version) or version
    assert r.evaluate(RecordingTrainer(2), ["p"]) == 2 and published == []  # already sent
    assert r.evaluate(RecordingTrainer(3), ["p"]) == 3 and r.evaluate(RecordingTrainer(3), ["q"]) == 3
    assert published == [3] and asked == [2, 3, 3] and r.published_version() == 3
    assert r.precision_gap(RecordingTrainer(3), []) is None and r.engine_model() is None


def test_the_precision_probe_runs_only_where_placed():
    torch.manual_seed(0)
    model = build_model(load_config(None, []).model, 16)
    worker = SimpleNamespace(engine=SimpleNamespace(model=model))
    group = SimpleNamespace(samples=[SimpleNamespace(prompt_ids=[1, 2, 3], response_ids=[4, 5])])
    trainer = RecordingTrainer(0, model)
    assert LocalRollouts(None, None, worker, LocalWeights()).precision_gap(trainer, [group]) is None
    gap = LocalRollouts(None, None, worker, LocalWeights(), probes_precision=True).precision_gap(
        trainer, [group]
    )
    assert (gap.tokens, gap.logprob_gap_max, gap.greedy_agreement) == (2, 0.0, 1.0)  # the same model: no gap
    assert model.training  # the trainer's mode is given back


def test_the_run_starts_the_side_its_placement_names(monkeypatch):
    seen = []
    for runs_on in (IN_DRIVER, RAY_ACTORS):
        monkeypatch.setitem(ROLLOUT_SIDES, runs_on, lambda start, name=runs_on: seen.append(name) or name)
    for mode, expected in (("sync", IN_DRIVER), ("async", RAY_ACTORS)):
        cfg = load_config(None, [f"runtime.mode={mode}"])
        start = RolloutsStart(cfg, Placement.from_config(cfg), None, None, None, 0, None)
        assert start_rollouts(start) == expected
    assert seen == [IN_DRIVER, RAY_ACTORS]


def test_the_in_process_side_needs_the_drivers_components():
    cfg = load_config(None, ["runtime.mode=sync"])
    start = RolloutsStart(cfg, Placement.from_config(cfg), None, None, None, 0, None)
    with pytest.raises(ValueError, match="after the components"):
        start_rollouts(start)
