"""The weight store's background writer: durable copies of versions off the trainer's critical path.

    publish_in_background(v, tensors) -> copier thread: HostSnapshot.take (host copy) -> writer thread:
    wait for the copy -> serialize, sha256, files, manifest last (``WeightStore``) -> the buffer is free

A version that must be durable (version 0, every ``runtime.durable_every``-th, a checkpoint's, the last) is
handed over without waiting: a copier thread copies it into host buffers at once (``PendingCopies``
counts the copies not taken yet; the trainer waits for them before it next updates its tensors in place,
so it generates or runs its forward and backward passes meanwhile), and the serialization, checksums and
I/O run on the store's one writer thread. On CUDA the copy is a non-blocking device-to-host copy into
page-locked (pinned) host buffers queued on the tensors' current stream (the trainer's later kernels on
that stream run after it); on CPU a ``memcpy`` into host buffers kept from the previous snapshot (no page
faults after the first).

Memory is bounded: at most ``max_pending`` versions are handed over and not yet written (each holds one
host copy of the model, made when first needed and reused after). When the writer is behind, a new
hand-over waits for the oldest write to finish: a version that must be durable is never dropped.

A failed write is kept and raised, as ``WeightWriteError`` (one line naming the version, the store and the
cause; a ``StorageError`` the ``moerl`` command prints as one line, with a full disk's ``errno`` and file
so that a run stops as on any full disk), by the next ``check`` (a run's next step), ``submit`` or
``flush`` (the run's end).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moerl.errors import WeightWriteError

log = logging.getLogger(__name__)


class HostSnapshot:
    """Host copies of one version's tensors, in buffers reused for the next version of the same shapes.

    On CUDA the buffers are page-locked and filled by non-blocking copies on each tensor's current
    stream; ``wait`` blocks until they have landed (the writer thread calls it, never the trainer).
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._copied: list[torch.cuda.Event] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the host buffers."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _fits(self, named: Mapping[str, torch.Tensor]) -> bool:
        if named.keys() != self.tensors.keys():
            return False
        return all(
            (h.dtype, h.shape, h.is_pinned()) == (t.dtype, t.shape, t.is_cuda)
            for h, t in ((self.tensors[n], t) for n, t in named.items())
        )

    def take(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``named`` (name -> tensor, any device) into this snapshot's host buffers (made or remade
        when the names, dtypes or shapes changed) and return them. CUDA: non-blocking, ordered on the
        current stream of each tensor's device; call ``wait`` before reading the copies."""
        if not self._fits(named):
            self.tensors = {
                n: torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for n, t in named.items()
            }
        devices = set()
        for name, t in named.items():
            self.tensors[name].copy_(t.detach(), non_blocking=t.is_cuda)
            if t.is_cuda:
                devices.add(t.device)
        self._copied = []
        for device in devices:  # the copies are queued on each device's current stream: mark their end
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copied.append(event)
        return self.tensors

    def wait(self) -> None:
        """Block until the copies of the last ``take`` have landed (no-op on CPU)."""
        for event in self._copied:
            event.synchronize()


class PendingCopies:
    """Copies of a trainer's live tensors handed over and not yet taken (by the store's copier thread, or
    an overlapped send's): whoever changes those tensors in place calls ``wait`` first (the run hooks it
    before its trainer's optimizer step, ``torch.optim.Optimizer.register_step_pre_hook``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num = 0

    def begin(self) -> None:
        """One more copy to take."""
        with self._cond:
            self._num += 1

    def end(self) -> None:
        """A copy was taken (or given up)."""
        with self._cond:
            self._num -= 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every copy begun so far was taken (queued, on CUDA: ordered before later kernels)."""
        with self._cond:
            while self._num:
                self._cond.wait()


class DurableWriter:
    """Writes versions on one background thread from host snapshots, at most ``max_pending`` at a time.

    A hand-over returns at once: a copier thread takes the host snapshot (``copies`` counts those not
    taken yet: the trainer waits for them before its next in-place update, while it generates or runs
    its forward and backward passes meanwhile) and queues the write; the writer thread writes in order.

    Args:
        write: ``(version, name -> CPU tensor, max_shard_bytes) -> object``: the store's own write (files
            first, manifest last); runs on the writer thread.
        where: the store's URL, for error lines.
        max_pending: most versions handed over and not yet written (>= 1); each holds one host copy of
            the model while it waits.

    Raises:
        ValueError: ``max_pending`` < 1.
    """

    def __init__(self, write: Callable[..., object], where: str, *, max_pending: int = 2) -> None:
        if max_pending < 1:
            raise ValueError(f"DurableWriter: max_pending={max_pending} must be >= 1")
        self.write, self.where, self.max_pending = write, where, max_pending
        self.copies = PendingCopies()
        """Host snapshots handed over and not yet taken: ``wait`` before changing the tensors."""
        self._cond = threading.Condition()
        self._free: list[HostSnapshot] = []  # host buffers no pending write reads
        self._num_pending = 0
        self._futures: deque[Future] = deque()
        self._error: WeightWriteError | None = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerl-weight-copy")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerl-weight-store")
        self.wait_s = 0.0
        """Seconds ``submit`` callers waited for the writer to catch up (0 while it keeps up)."""
        self.last_take_s = 0.0
        """Seconds the copier took for the last host snapshot."""

    def submit(
        self,
        version: int,
        named: Mapping[str, torch.Tensor],
        *,
        max_shard_bytes: int | None = None,
        copy: bool = True,
    ) -> Future:
        """Hand ``named`` over as ``version``: a host snapshot is taken on the copier thread
        (``copy``; ``False``: the tensors are CPU buffers nobody writes, taken as they are) and written on
        the writer thread. The caller must not change ``named`` in place before ``copies.wait()``.
        Waits while ``max_pending`` writes are pending. Returns the write's ``Future``.

        Raises:
            WeightWriteError: an earlier write failed (raised once).
        """
        self.check()
        t0 = time.perf_counter()
        with self._cond:
            while self._num_pending >= self.max_pending:
                self._cond.wait()
            self._num_pending += 1
            snapshot = (self._free.pop() if self._free else HostSnapshot()) if copy else None
            future: Future = Future()
            while self._futures and self._futures[0].done():  # their errors are kept by _write
                self._futures.popleft()
            self._futures.append(future)
        self.wait_s += time.perf_counter() - t0
        if snapshot is not None:
            self.copies.begin()
        self._copier.submit(self._take, version, snapshot, dict(named), max_shard_bytes, future)
        return future

    def _take(self, version: int, snapshot: HostSnapshot | None, named, max_shard_bytes, future) -> None:
        t0 = time.perf_counter()
        try:
            tensors = snapshot.take(named) if snapshot is not None else named
        except BaseException as e:
            self._fail(version, e, snapshot, future)
            return
        finally:
            if snapshot is not None:
                self.copies.end()
        self.last_take_s = time.perf_counter() - t0
        self._writer.submit(self._write, version, snapshot, tensors, max_shard_bytes, future)

    def _write(self, version: int, snapshot: HostSnapshot | None, tensors, max_shard_bytes, future) -> None:
        try:
            if snapshot is not None:
                snapshot.wait()
            result = self.write(version, tensors, max_shard_bytes)
        except BaseException as e:
            self._fail(version, e, snapshot, future)
            return
        self._release(snapshot)
        future.set_result(result)

    def _fail(self, version: int, e: BaseException, snapshot: HostSnapshot | None, future: Future) -> None:
        """Keep the first failure as a one-line ``WeightWriteError`` for ``check``; free the slot."""
        message = " ".join(str(e).split()) or type(e).__name__
        error = WeightWriteError(
            f"weight store: background write of version {version} to {self.where} failed: "
            f"{type(e).__name__}: {message}"
        )
        if isinstance(e, OSError) and e.errno is not None:  # a full disk stays one (errno, file)
            error.errno, error.filename = e.errno, e.filename
        error.__cause__ = e
        log.error("%s", error)
        with self._cond:
            if self._error is None:
                self._error = error
        self._release(snapshot)
        future.set_exception(error)

    def _release(self, snapshot: HostSnapshot | None) -> None:
        with self._cond:
            self._num_pending -= 1
            if snapshot is not None:
                self._free.append(snapshot)
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the first failed write's ``WeightWriteError`` (once); returns at once otherwise."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait until every write handed over so far has finished.

        Raises:
            WeightWriteError: a write failed (its version was not committed); raised once.
        """
        while True:
            with self._cond:
                if not self._futures:
                    break
                future = self._futures.popleft()
            future.exception()  # waits; the error itself is kept by _fail
        self.check()

    @property
    def num_pending(self) -> int:
        """Versions handed over and not yet written."""
        with self._cond:
            return self._num_pending

    def close(self) -> None:
        """Finish the pending writes and stop the threads (errors stay for ``check``)."""
        self._copier.shutdown(wait=True)
        self._writer.shutdown(wait=True)
