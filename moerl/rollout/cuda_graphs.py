"""CUDA graphs for the engine's decode step: capture once per shape key, replay afterwards.

A decode step of the reference model launches well over a thousand small kernels (16 layers of norms,
projections, rotary, cache writes, attention, routing, grouped GEMMs, then the sampler); launched one by
one from Python, the launch time exceeds the device time at decode batch sizes. Captured in a CUDA graph
(``torch.cuda.CUDAGraph``) the whole step is one launch.

What a captured function must satisfy (the engine's decode step does, with the sync-free experts of
``moerl.models.kernels``):

- it reads its inputs only from tensors whose storage outlives the graph (the engine's per-slot state
  and KV cache, preallocated once), so a replay sees the current values;
- it never waits for the device (no ``.item()``, ``.tolist()``, ``bincount`` on CUDA, data-dependent
  shapes), and its Python control flow depends only on the key;
- running it twice with the same inputs is harmless: the warm-up run before the capture really
  executes (the engine's decode forward rewrites the same keys/values at the same positions and
  samples without side effects; the engine advances its per-slot state outside the graph).

Graphs of different keys share one memory pool; a replay's outputs are copied out before returning, so
the next replay (of any key) may reuse that memory.

Keys must recur for graphs to pay off: a run's decode batch size B and read length R change every few
steps, so engines round them to a small set first (``graph_batch_buckets``, ``round_read_len``). At most
``max_graphs`` are kept; a new key beyond that evicts the least recently replayed graph (a key seen again
is captured again), so decoding never falls back to eager for good because a run met many shapes.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def graph_batch_buckets(max_rows: int) -> tuple[int, ...]:
    """Decode batch sizes a CUDA-graph engine rounds B up to: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of
    two and 1.5 times them, as vLLM and SGLang capture a fixed list of sizes), capped by and including
    ``max_rows``. A batch pads at most to 1.5x its rows; 256 rows need 16 sizes.

    Raises:
        ValueError: ``max_rows`` below 1.
    """
    if max_rows < 1:
        raise ValueError(f"graph_batch_buckets: max_rows={max_rows} must be >= 1")
    sizes, p = {1, max_rows}, 1
    while p < max_rows:
        sizes.update(x for x in (p, p + p // 2) if x < max_rows)
        p *= 2
    return tuple(sorted(sizes))


def round_read_len(n: int, multiple: int, cap: int) -> int:
    """``n`` (a decode step's read length, tokens or blocks) rounded up to a CUDA-graph key: a multiple of
    ``multiple`` and of a quarter of the largest power of two <= ``n``, so at most 25% over ``n`` once
    ``n`` > 4 ``multiple``, and four keys per doubling; capped at ``cap``.

    Raises:
        ValueError: ``n``, ``multiple`` or ``cap`` below 1.
    """
    if n < 1 or multiple < 1 or cap < 1:
        raise ValueError(f"round_read_len: n={n}, multiple={multiple}, cap={cap} must all be >= 1")
    grain = max(multiple, (1 << (n.bit_length() - 1)) // 4)
    return min(cap, -(-n // grain) * grain)


class GraphRunner:
    """Keyed capture-and-replay of a function returning a tuple of tensors.

    Args:
        device: where the function runs; on a non-CUDA device ``run`` just calls the function.
        max_graphs: most graphs kept; a new key beyond them evicts the least recently replayed one.

    Raises:
        ValueError: ``max_graphs`` below 1.
    """

    def __init__(self, device: torch.device | str, *, max_graphs: int = 192) -> None:
        if max_graphs < 1:
            raise ValueError(f"GraphRunner: max_graphs={max_graphs} must be >= 1")
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self.is_enabled = self.device.type == "cuda"
        """False on CPU, and after a capture failed (everything then runs eagerly)."""
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = (
            OrderedDict()
        )
        self._pool = torch.cuda.graph_pool_handle() if self.is_enabled else None
        self.num_replays = 0
        """Calls served by a replay (a capture's first replay included)."""
        self.num_captures = 0
        """Graphs captured (a key evicted and met again counts again)."""
        self.num_evictions = 0
        """Graphs dropped to stay within ``max_graphs``."""

    @property
    def num_graphs(self) -> int:
        """Graphs held now (at most ``max_graphs``)."""
        return len(self._graphs)

    @property
    def keys(self) -> list[Hashable]:
        """Keys of the graphs held, least recently replayed first."""
        return list(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """``fn()``'s outputs, from the graph of ``key`` (captured on first use) when possible.

        Args:
            key: everything the shapes and the Python path of ``fn`` depend on.
            fn: the step; see the module docstring for what it must satisfy.
        Returns:
            Fresh tensors (copies of the graph's static outputs), safe to keep across replays.
        """
        if not self.is_enabled:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)  # its memory goes back to the shared pool
                self.num_evictions += 1
            entry = self._capture(key, fn)
            if entry is None:
                return fn()
            self._graphs[key] = entry
            self.num_captures += 1
        else:
            self._graphs.move_to_end(key)
        graph, outs = entry
        graph.replay()
        self.num_replays += 1
        return tuple(o.clone() for o in outs)

    def _capture(self, key: Hashable, fn: Callable[[], tuple[torch.Tensor, ...]]):
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                fn()  # warm-up: lazy initialisation (cuBLAS handles, Triton compiles) stays out of the graph
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe calls break the capture; a Ray actor's other
            # threads (weight fetch, calls served beside the loop) may touch CUDA meanwhile
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                outs = tuple(fn())
        except RuntimeError as e:  # a host sync or an unsupported op inside fn: stay eager from now on
            # an op of fn that broke the capture raises first; ending the capture then raises again and
            # hides it (``__context__``): name the first error and where fn called it
            first = _first_error(e)
            log.warning(
                "CUDA graph capture failed for key %r at %s (%s); decoding eagerly from now on; "
                "the process's other threads meanwhile: %s",
                key,
                _innermost_moerl_frame(first),
                str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__,
                _other_threads(),
            )
            torch.cuda.set_stream(current)  # a failed capture_end leaves the capture stream current
            self.is_enabled = False
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:  # the device reports the broken capture once more; eager work goes on
                log.debug("synchronize after the failed capture raised", exc_info=True)
            return None
        return graph, outs

    def clear(self) -> None:
        """Drop every captured graph (e.g. after the engine's buffers were reallocated)."""
        self._graphs.clear()


def _first_error(error: BaseException) -> BaseException:
    """The first exception of ``error``'s implicit chain (``__context__``): the one raised first."""
    seen = {id(error)}
    while error.__context__ is not None and id(error.__context__) not in seen:
        error = error.__context__
        seen.add(id(error))
    return error


def _innermost_moerl_frame(error: BaseException) -> str:
    """``file:line in function`` of the innermost moerl frame of ``error``'s traceback (where the op that
    broke the capture was called), or ``?``."""
    where = "?"
    for frame in traceback.extract_tb(error.__traceback__):
        if "moerl" in frame.filename.replace("\\", "/").split("/"):
            where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return where


def _other_threads(depth: int = 4) -> str:
    """Every other thread of the process with its innermost ``depth`` frames: a capture broken by CUDA
    work that another thread did meanwhile names that thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me, out = threading.get_ident(), []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = traceback.extract_stack(frame)[-depth:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))
        out.append(f"[{names.get(ident, ident)}: {where}]")
    return " ".join(out) or "none"
