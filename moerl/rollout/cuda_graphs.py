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
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class GraphRunner:
    """Keyed capture-and-replay of a function returning a tuple of tensors.

    Args:
        device: where the function runs; on a non-CUDA device ``run`` just calls the function.
        max_graphs: at most this many keys are captured; calls with further keys run eagerly.
    """

    def __init__(self, device: torch.device | str, *, max_graphs: int = 64) -> None:
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self.is_enabled = self.device.type == "cuda"
        """False on CPU, and after a capture failed (everything then runs eagerly)."""
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.is_enabled else None
        self.num_replays = 0
        """Calls served by a replay (a capture's first replay included)."""

    @property
    def num_graphs(self) -> int:
        """Keys captured so far."""
        return len(self._graphs)

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
            if len(self._graphs) >= self.max_graphs:
                return fn()
            entry = self._capture(key, fn)
            if entry is None:
                return fn()
        graph, outs = entry
        graph.replay()
        self.num_replays += 1
        return tuple(o.clone() for o in outs)

    def _capture(self, key: Hashable, fn: Callable[[], tuple[torch.Tensor, ...]]):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                fn()  # warm-up: lazy initialisation (cuBLAS handles, Triton compiles) stays out of the graph
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                outs = tuple(fn())
        except RuntimeError as e:  # a host sync or an unsupported op inside fn: stay eager from now on
            log.warning(
                "CUDA graph capture failed for key %r at %s (%s); decoding eagerly from now on",
                key,
                _innermost_moerl_frame(e),
                e,
            )
            torch.cuda.synchronize(self.device)
            self.is_enabled = False
            return None
        self._graphs[key] = (graph, outs)
        return graph, outs

    def clear(self) -> None:
        """Drop every captured graph (e.g. after the engine's buffers were reallocated)."""
        self._graphs.clear()


def _innermost_moerl_frame(error: BaseException) -> str:
    """``file:line in function`` of the innermost moerl frame of ``error``'s traceback (where the op that
    broke the capture was called), or ``?``."""
    where = "?"
    for frame in traceback.extract_tb(error.__traceback__):
        if "moerl" in frame.filename.replace("\\", "/").split("/"):
            where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return where
