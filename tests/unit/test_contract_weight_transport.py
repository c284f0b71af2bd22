"""Contract of a weight transport (``moerl.weights.transport.TRANSPORTS``; docs/extending.md "Weight
transport"), the part no Ray or process group is needed for: every registered transport, and any new
one, is registered under its own ``name``, declares the class attributes the run reads
(``supports_ep_rollout``, ``sends_from_snapshot``: bools), a static ``check_config``, and every method of
the ``WeightTransport`` Protocol with the Protocol's parameters; it reaches workers only through the
``OfferSink``s it is given (``moerl.weights.offer``; ``test_weight_offers.py`` scans for actor calls).

The behaviour half of the contract is ``tests/unit/test_weight_tables.py``: every transport moves
versions to a ``CheckedWeights`` receiver, refuses a damaged one (counted once) and switches to the next
good one (``test_a_tampered_table_is_refused_counted_and_the_next_good_version_switches``, parametrized
over ``CHANNELS``; ``test_every_transport_has_a_channel_here`` fails until a new transport adds its
channel there).
"""

from __future__ import annotations

import inspect

import pytest

from moerl.weights.transport import TRANSPORTS, WeightTransport

METHODS = ["publish", "offer_newest", "receiver_spec", "finish", "close"]


def check_transport_contract(name: str, cls: type) -> None:
    """Assert the static transport contract (module docstring) of ``cls`` registered as ``name``."""
    assert cls.name == name, f"registered as {name!r} but named {cls.name!r}"
    for flag in ("supports_ep_rollout", "sends_from_snapshot"):
        assert isinstance(getattr(cls, flag, None), bool), f"{name}: {flag} must be a bool class attribute"
    assert isinstance(inspect.getattr_static(cls, "check_config"), staticmethod), (
        f"{name}: check_config static"
    )
    declared = inspect.signature(WeightTransport.check_config).parameters
    assert list(inspect.signature(cls.check_config).parameters) == list(declared), f"{name}: check_config"
    for method in METHODS:
        want = list(inspect.signature(getattr(WeightTransport, method)).parameters)
        got = list(inspect.signature(getattr(cls, method)).parameters)
        assert got == want, f"{name}.{method}{got} != WeightTransport.{method}{want}"


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_registered_transport_meets_the_static_contract(name):
    check_transport_contract(name, TRANSPORTS[name])


def test_a_transport_that_needs_a_worker_method_is_refused():
    class Chatty(TRANSPORTS["store"]):
        def publish(self, trainer, handles, *, durable=None):  # actor handles, not sinks
            for h in handles:
                h.offer_weights.remote(trainer.version)

    with pytest.raises(AssertionError, match="publish"):
        check_transport_contract("store", Chatty)
