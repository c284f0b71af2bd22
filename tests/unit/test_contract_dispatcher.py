"""Contract of an EP dispatcher (``moerl.ep.registry.DISPATCHERS``; docs/extending.md "Dispatcher"), the
part no process group is needed for: every registered backend, and any new one, is a builder
``(topology, num_experts, group=None, *, placement) -> Dispatcher`` whose ``dispatch`` and ``combine``
take the ``Dispatcher`` Protocol's parameters.

The behaviour half is ``tests/unit/test_ep_interface.py``, parametrized over every registered backend
(``BACKENDS``) on a one-rank gloo group: the protocol's returns and shapes, and an MoE layer sharded with
the backend equal to the same layer on one device, forward and gradients (float64 gradcheck); the
multi-rank cases are ``tests/distributed``.
"""

from __future__ import annotations

import inspect

import pytest

from moerl.ep.dispatcher import Dispatcher
from moerl.ep.registry import DISPATCHERS

BUILDER_PARAMETERS = ["topology", "num_experts", "group", "placement"]


def check_dispatcher_contract(name: str, builder) -> None:
    """Assert the static dispatcher contract (module docstring) of ``builder`` registered as ``name``."""
    params = inspect.signature(builder).parameters
    assert list(params)[: len(BUILDER_PARAMETERS)] == BUILDER_PARAMETERS, f"{name}: builder {list(params)}"
    assert params["placement"].kind is inspect.Parameter.KEYWORD_ONLY, f"{name}: placement is keyword-only"
    for method in ("dispatch", "combine"):
        want = list(inspect.signature(getattr(Dispatcher, method)).parameters)
        got = list(inspect.signature(getattr(builder, method)).parameters)
        assert got == want, f"{name}.{method}{got} != Dispatcher.{method}{want}"


@pytest.mark.parametrize("name", sorted(DISPATCHERS))
def test_registered_dispatcher_meets_the_static_contract(name):
    check_dispatcher_contract(name, DISPATCHERS[name])


def test_a_dispatcher_without_the_routing_weights_is_refused():
    class Weightless(DISPATCHERS["alltoall"]):
        def dispatch(self, x, topk_idx):  # the routing weights dropped
            return super().dispatch(x, topk_idx, None)

    with pytest.raises(AssertionError, match="dispatch"):
        check_dispatcher_contract("weightless", Weightless)
