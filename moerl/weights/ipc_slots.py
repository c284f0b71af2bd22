"""The shared slots and the control connections of ``runtime.weight_sync=cuda_ipc`` (``ipc_sync.py``).

A slot is one flat uint8 buffer that the trainer writes and the engines read. Its handle is what an engine
needs to map it, and travels pickled over the control connection:

- on CUDA: ``torch.multiprocessing.reductions.reduce_tensor`` of the device tensor (a ``cudaIpc`` memory
  handle plus PyTorch's reference-counting and event handles); the engine rebuilds the tensor from it.
- in host memory: a named POSIX shared-memory segment (``multiprocessing.shared_memory``, Linux's
  ``/dev/shm``), which any process on the host can map by name; optionally page-locked (``cudaHostRegister``) in each process.
  (``reduce_tensor`` of a CPU tensor would pass a file descriptor through the sender's
  ``multiprocessing`` resource sharer, which only processes spawned by the sender may reach: Ray actors
  may not.)

Control connections are ``multiprocessing.connection`` objects: a ``Pipe`` end for processes spawned by the
trainer, or ``IpcListener`` (a Unix socket with a random auth key) for processes started otherwise (the
rollout worker actors).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import shutil
import tempfile
import threading
import weakref
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory

import torch
from torch.multiprocessing.reductions import reduce_tensor

log = logging.getLogger(__name__)


def pin_no_sync(t: torch.Tensor) -> bool:
    """Page-lock a CPU tensor's memory in this process (``cudaHostRegister``), so that copies between it
    and the GPU run at full speed and asynchronously; False where that is not possible."""
    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except (AttributeError, RuntimeError) as e:  # a torch build without the binding: stay pageable
        log.warning("cudaHostRegister unavailable (%s): host slots stay pageable", e)
        return False
    return int(err) == 0


class Slots:
    """``num_slots`` zeroed flat uint8 buffers of ``nbytes`` on ``device`` (CUDA memory, or named host
    shared memory for ``cpu``), made once by the trainer; ``handles`` are what engines open."""

    def __init__(self, num_slots: int, nbytes: int, device: torch.device, *, pin: bool = False) -> None:
        self.device = device
        self._segments: list[SharedMemory] = []
        if device.type == "cpu":
            self.buffers = []
            for _ in range(num_slots):
                shm = SharedMemory(create=True, size=nbytes)
                self._segments.append(shm)
                self.buffers.append(torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes))
            for b in self.buffers:
                b.zero_()
            # removed with this object at the latest (also on an error path): segments outlive processes
            self._finalizer = weakref.finalize(self, _unlink, list(self._segments))
            self.handles = [("shm", s.name, nbytes) for s in self._segments]
            self.is_pinned = pin and all([pin_no_sync(b) for b in self.buffers])
        else:
            self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
            self.handles = [("cuda", reduce_tensor(b)) for b in self.buffers]
            self.is_pinned = False

    def close(self) -> None:
        """Remove the shared-memory segments (engines that mapped them keep their mappings)."""
        self.buffers = []
        self._segments = []
        if self.device.type == "cpu":
            self._finalizer()


def _unlink(segments: list[SharedMemory]) -> None:
    for shm in segments:
        try:
            shm.unlink()  # and off the resource tracker's list
        except FileNotFoundError:
            pass


class OpenedSlots:
    """An engine's mapping of the trainer's slots, from ``Slots.handles``."""

    def __init__(self, handles: list, *, pin: bool = False) -> None:
        self._segments: list[mmap.mmap] = []
        self.buffers: list[torch.Tensor] = []
        for handle in handles:
            if handle[0] == "shm":
                # mapped as a file, not SharedMemory(name=...): that would register the segment with this
                # process's resource tracker, which unlinks it when this process exits (Python < 3.13),
                # while the trainer, its owner, still hands it to engines started later
                _, name, nbytes = handle
                with open(f"/dev/shm/{name}", "r+b") as f:
                    segment = mmap.mmap(f.fileno(), nbytes)
                self._segments.append(segment)
                self.buffers.append(torch.frombuffer(segment, dtype=torch.uint8, count=nbytes))
            else:
                fn, args = handle[1]
                self.buffers.append(fn(*args))  # maps the device memory (once)
        is_host = bool(self.buffers) and self.buffers[0].device.type == "cpu"
        self.is_pinned = pin and is_host and all([pin_no_sync(b) for b in self.buffers])


class IpcListener:
    """Where engines started by others (Ray actors on this host) connect: a Unix socket in a private
    temporary folder with a random auth key; connections are accepted on a thread (``take_new``)."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="moerl-ipc-")
        self.address = os.path.join(self._folder, "sync.sock")
        self.authkey = os.urandom(16)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._new: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._closed = threading.Event()
        threading.Thread(target=self._accept_loop, name="moerl-ipc-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._new.put(self._listener.accept())
            except OSError:  # closed (or a client that failed the auth challenge)
                if self._closed.is_set():
                    return
            except Exception:
                log.exception("weight-sync listener: a connection failed")

    def take_new(self) -> list[Connection]:
        """Connections accepted since the last call."""
        out = []
        while True:
            try:
                out.append(self._new.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stop accepting; remove the socket's folder."""
        self._closed.set()
        self._listener.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def connect(address: str, authkey: bytes) -> Connection:
    """An engine's control connection to an ``IpcListener``."""
    return Client(address, family="AF_UNIX", authkey=authkey)
