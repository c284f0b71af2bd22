"""Weight movement: the versioned store (``store.py``) and the transports that carry a trainer's version to
the rollout workers (``transport.py``: one ``WeightTransport`` Protocol, registered by name in
``TRANSPORTS`` and chosen by ``runtime.weight_sync``). Weights flow one way: trainer -> transport ->
workers, with the durable store written in the background."""

from moerl.weights.store import ChecksumError, StoreNotWritableError, WeightStore

__all__ = ["ChecksumError", "StoreNotWritableError", "WeightStore"]
