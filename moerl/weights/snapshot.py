"""``WeightSnapshot``: a version's tensors copied on their device, sent by a weight transport on a thread
while the trainer trains on (``runtime.overlap_publish``, ``moerl.runtime.ray.rollouts``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from moerl.weights.buckets import StreamedVersion
from moerl.weights.store import WeightStore, WeightVersion
from moerl.weights.transports import stream_named


class WeightSnapshot:
    """The ``WeightHolder`` a transport asks (``moerl.weights.transport``), over device copies of one
    version's tensors taken now: the trainer may update its own tensors in place right after.

    Args:
        version: the policy version of ``named``.
        named: name -> tensor (the trainer's ``named_weights()``); copied on its device (one extra copy
            of the model there until the snapshot is dropped).
        reuse: the ``tensors`` of an earlier snapshot nobody reads any more (its send is done): copied
            into when their names, dtypes, shapes and devices match (no allocation, no page faults: on CPU
            a ``memcpy``), else ignored; None: fresh clones.
    """

    num_ranks = 1

    def __init__(
        self, version: int, named: Mapping[str, torch.Tensor], reuse: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.version = int(version)
        if reuse is not None and _same_layout(reuse, named):
            for name, t in named.items():
                reuse[name].copy_(t.detach())
            self.tensors = reuse
        else:
            self.tensors = {n: t.detach().clone() for n, t in named.items()}
        devices = {t.device for t in self.tensors.values()}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self._copied = None
        if self.device.type == "cuda":  # the copies are queued on this thread's stream: mark their end
            self._copied = torch.cuda.Event()
            self._copied.record()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The copied tensors by name."""
        return self.tensors

    def stream_buckets(self, sink, bucket_bytes: int) -> StreamedVersion:
        """Pack the copy in buckets of about ``bucket_bytes`` and send each to ``sink``."""
        return stream_named(self.version, self.tensors, bucket_bytes, sink)

    def publish(self, store: WeightStore) -> WeightVersion:
        """Write the copy to ``store`` as ``version``."""
        return store.publish(self.version, self.tensors)

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Where the sending thread reads the copy: on CUDA a side stream that first waits for the
        copies (the trainer's next step keeps the default stream), elsewhere nothing."""
        if self._copied is None:
            yield
            return
        side = torch.cuda.Stream(device=self.device)
        side.wait_event(self._copied)
        with torch.cuda.stream(side):
            yield
        side.synchronize()


def _same_layout(reuse: Mapping[str, torch.Tensor], named: Mapping[str, torch.Tensor]) -> bool:
    """``reuse`` has ``named``'s names, each with its dtype, shape and device."""
    return reuse.keys() == named.keys() and all(
        (reuse[n].dtype, reuse[n].shape, reuse[n].device) == (t.dtype, t.shape, t.device)
        for n, t in named.items()
    )
