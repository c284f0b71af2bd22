"""Both rollout sides implement the declared ``Rollouts`` interface with the same signatures."""

import inspect

import pytest

from moerl.runtime.local import LocalRollouts
from moerl.runtime.ray import RayRollouts
from moerl.runtime.rollouts import Rollouts

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
    } <= set(METHODS)


@pytest.mark.parametrize("impl", [LocalRollouts, RayRollouts])
def test_each_implementation_has_every_method_with_the_protocol_signature(impl):
    for name in METHODS:
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        declared = list(inspect.signature(getattr(Rollouts, name)).parameters)
        actual = list(inspect.signature(getattr(impl, name)).parameters)
        assert actual == declared, f"{impl.__name__}.{name}{actual} != Rollouts.{name}{declared}"
