"""How a trainer's version reaches the rollout workers: one ``WeightTransport`` interface, its
implementations registered by name in ``TRANSPORTS`` (chosen by ``runtime.weight_sync``).

    trainer --stream_buckets / named_weights / publish--> WeightTransport --> workers' WeightSource
                                                              \\--> WeightStore (durable, background)

- sending side (the driver builds it): ``publish`` asks the trainer for its version (buckets into a
  ``BucketSink``, or whole tensors) and sends it to the workers, each an ``OfferSink`` the caller passes
  in (``moerl.weights.offer``: a ``WeightOffer`` per whole version or bucket; a transport that moves the
  bytes itself, ``collective`` or ``cuda_ipc``, offers nothing); ``offer_newest`` gives a newly started
  worker the newest version; ``finish`` makes the last version durable; ``close``. The weights package
  never names a worker process or method: a new transport needs no new rollout-worker method.
- receiving side: ``receiver_spec()`` is a small picklable ``ReceiverSpec`` that travels to each worker
  process; ``spec.for_worker(num_ranks).open(fallback=..., device=..., rank=r)`` is each rank's
  ``moerl.weights.sources.WeightSource``, polled between scheduler steps (a version switches only when
  whole). ``fallback`` is the weight store (``StoreWeights``): what a worker loads at start.
- config: each transport class checks the combinations it supports (``check_config``); config
  validation calls ``check_transport`` and takes its choice list from ``TRANSPORTS``.

Sync mode (``runtime.mode=sync``) hands weights over in process (``moerl.weights.sources.LocalWeights``,
through ``moerl.runtime.local.LocalRollouts.publish``), whatever ``runtime.weight_sync`` says.

This module sits low in the layer order: config sections and trainers are duck-typed (their types are
imported for checkers only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from moerl.weights.buckets import PublishReport, StreamedVersion, SyncStats, WeightBucket
from moerl.weights.collective import CollectiveTransport
from moerl.weights.offer import OfferSink
from moerl.weights.transports import CudaIpcTransport, ObjectStoreTransport, StoreTransport

if TYPE_CHECKING:
    from moerl.config import RuntimeConfig
    from moerl.records import WeightVersion
    from moerl.weights.store import WeightStore


class BucketSink(Protocol):
    """Where a trainer sends the buckets of a version, in index order (picklable: it may travel to the
    trainer rank that holds the weights)."""

    def send(self, bucket: WeightBucket) -> object:
        """Consume ``bucket`` before returning (its buffer is reused); returns its ref, or None."""
        ...


class WeightHolder(Protocol):
    """What a transport asks of a trainer (the one-process trainer and the sharded group)."""

    version: int

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The current version's full tensors by state-dict name."""
        ...

    def publish(self, store: WeightStore) -> WeightVersion | None:
        """Write the current version to ``store``."""
        ...

    def stream_buckets(self, sink: BucketSink, bucket_bytes: int) -> StreamedVersion:
        """Pack the current version in buckets of about ``bucket_bytes`` and send each to ``sink``."""
        ...


class WeightReceiver(Protocol):
    """A worker rank's end of a transport: a ``WeightSource`` with its figures."""

    stats: SyncStats

    def poll(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """A whole version newer than ``version`` (zero-copy views, to be copied into the engine), or None."""
        ...


class ReceiverSpec(Protocol):
    """Picklable: what a worker needs to open its receiving side."""

    def for_worker(self, num_ranks: int) -> ReceiverSpec:
        """The spec of one worker of ``num_ranks`` EP ranks (all its ranks open the same one)."""
        ...

    def open(self, *, fallback, device, rank: int = 0) -> WeightReceiver:
        """EP rank ``rank``'s receiver; ``fallback``: the ``WeightSource`` polled when nothing newer came."""
        ...


class WeightTransport(Protocol):
    """The sending side of ``runtime.weight_sync`` (module docstring). Built as ``cls(runtime, store)``."""

    name: ClassVar[str]
    supports_ep_rollout: ClassVar[bool]
    sends_from_snapshot: ClassVar[bool]
    """``publish`` may run on a thread from a device copy of the version (``WeightSnapshot``) while the
    trainer trains on (``runtime.overlap_publish``); False: it runs on the step's path."""

    @staticmethod
    def check_config(runtime: RuntimeConfig, *, trainer_ranks: int, rollout_ep_size: int) -> None:
        """Raises ValueError (one line naming the fields) for a combination this transport cannot serve."""
        ...

    def publish(
        self, trainer: WeightHolder, workers: Sequence[OfferSink], *, durable: bool | None = None
    ) -> PublishReport:
        """Send the trainer's current version to ``workers`` (one ``OfferSink`` per rollout worker).

        Args:
            durable: also write the store: None when due (``runtime.durable_every``), False: the caller
                already wrote it (a trainer recovery), True: always.
        """
        ...

    def offer_newest(self, worker: OfferSink) -> None:
        """Give a newly started worker (its ``OfferSink``) the newest version (it loaded the store's
        newest at start)."""
        ...

    def receiver_spec(self) -> ReceiverSpec:
        """What each worker opens its receiving side from."""
        ...

    def finish(self, trainer: WeightHolder) -> None:
        """The trainer's current (last) version is in the durable store once this returns."""
        ...

    def close(self) -> None:
        """Release what the transport holds (listeners, groups)."""
        ...


TRANSPORTS: dict[str, type[WeightTransport]] = {
    t.name: t for t in (ObjectStoreTransport, CollectiveTransport, CudaIpcTransport, StoreTransport)
}
"""``runtime.weight_sync`` -> its transport class; the config's choice list."""


def check_transport(runtime: RuntimeConfig, *, trainer_ranks: int, rollout_ep_size: int) -> None:
    """``TRANSPORTS[runtime.weight_sync].check_config``.

    Raises:
        ValueError: an unknown transport, or a combination it cannot serve.
    """
    if runtime.weight_sync not in TRANSPORTS:
        raise ValueError(f"runtime.weight_sync={runtime.weight_sync!r}: choose from {sorted(TRANSPORTS)}")
    TRANSPORTS[runtime.weight_sync].check_config(
        runtime, trainer_ranks=trainer_ranks, rollout_ep_size=rollout_ep_size
    )


def make_transport(runtime: RuntimeConfig, store: WeightStore | None) -> WeightTransport:
    """The transport ``runtime.weight_sync`` names, for the run's ``store``."""
    return TRANSPORTS[runtime.weight_sync](runtime, store)
