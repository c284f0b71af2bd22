"""What a sending transport hands a rollout worker, whatever the transport: a ``WeightOffer``, delivered
through an ``OfferSink`` the caller passes in.

    transport.publish(trainer, sinks)  --WeightOffer-->  sink(offer)  -->  worker's WeightSource.receive(offer)

The weights package never names a worker process: the runtime turns each rollout worker into an
``OfferSink`` (on Ray, ``moerl.runtime.ray.worker_actor.WorkerOffers``: the actor's one
``receive_weights`` method, not waited for) and the worker hands each offer to its receiving side
(``OfferedWeights.receive``, ``BucketAssembler.receive``). A new transport adds a ``WeightOffer``
producer and a receiving side, never a new worker method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightOffer:
    """One piece of a policy version offered to a worker: a whole version or one of its buckets."""

    version: int
    """The policy version the piece belongs to."""
    ref: object
    """Where the piece is: a Ray object ref (nested in this record, so Ray passes the ref itself, not
    its value), or any key the worker's receiving side resolves (tests: an index)."""
    index: int = 0
    """The bucket's index in the version (0 for a whole version)."""
    num_buckets: int | None = None
    """Buckets of the version; None: ``ref`` is the whole version (``PackedWeights``)."""
    to_followers: bool = True
    """An EP group's leader forwards the offer to its follower ranks (each fetches the same object and
    keeps its experts); False: only the leader takes it (a whole version: followers poll the store)."""

    @property
    def is_whole(self) -> bool:
        """``ref`` holds the whole version."""
        return self.num_buckets is None

    @property
    def completes_version(self) -> bool:
        """The last piece of its version (a whole version, or the last bucket): an idle worker wakes."""
        return self.num_buckets is None or self.index == self.num_buckets - 1


OfferSink = Callable[[WeightOffer], None]
"""Delivers a ``WeightOffer`` to one rollout worker without waiting for it (picklable: it may travel to
the trainer rank that packs the buckets)."""
