"""The engine's KV-cache policy: one component object, chosen by the caller, behind a small Protocol.

    Engine (one loop: admit -> prefill -> make room -> decode -> sample -> sync/finish)
      └── CachePolicy  (``SlotCachePolicy`` slots | ``PagedCachePolicy`` blocks, or a new one)
            ├── scheduler   host admission: which waiting samples run now (``scheduler.Scheduler``)
            ├── kv          the model's seam object (``update`` / ``attn_mask``; ``moerl.models.layers.KVCache``)
            └── row_state   per-row device tensors the engine moves with a row on compaction

The engine owns the model forward, sampling, the per-row sampling state, the host sync and CUDA graphs;
the policy owns where keys/values live: admission and allocation, sharing a group's prompt, freeing,
eviction (preemption) when memory runs out, and the indices a bound forward reads and writes. nano-vllm's
``Scheduler`` holding its ``BlockManager`` is the model (``engine/block_manager.py``).

Shapes: N rows (``num_slots``), R prefill rows, T padded new tokens per prefill row, B decode rows,
Lm MoE layers, K top-k.

A new policy implements ``CachePolicy``, takes a ``CacheSpec`` in its constructor, is passed to
``Engine(model, cache=MyPolicy)`` (or registered in ``engine.CACHE_POLICIES`` under a name) and must pass
``tests/unit/test_cache_policy_contract.py`` (docs/extending.md, "Cache policy").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from moerl.rollout.kv_cache import KVLayout
from moerl.rollout.scheduler import Admission, Scheduler, Sequence


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheSpec:
    """What an engine tells its cache policy at construction (sizes in tokens and rows).

    A policy reads the fields it needs and raises ``ValueError`` (one line) for sizes it cannot serve
    or a field that does not apply to it.
    """

    layout: KVLayout
    """The model's KV geometry (``kv_cache.kv_layout``)."""
    dtype: torch.dtype
    """Of the cached keys/values (the model's parameters')."""
    device: torch.device
    """Where the cache lives (the model's)."""
    context: int
    """The model's ``max_position_embeddings``: no sequence is longer."""
    num_attention_heads: int
    """Query heads of the model (a paged decode groups ``num_attention_heads // num_kv_heads`` rows)."""
    max_slots: int
    """Most sequences running (decoding) together."""
    kv_token_budget: int
    """Cache capacity in tokens over all sequences."""
    max_prefill_tokens: int
    """Tokens computed by the prefills of one step (at least one admission)."""
    max_seq_len: int | None = None
    """Tokens per sequence, where the policy reserves them up front (slots); None: the policy's default."""
    block_size: int | None = None
    """Tokens per block, where the policy pages (paged); None: the policy's default."""


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """One row of a prefill forward: ``seq``'s cache receives positions ``start..len(tokens)-1``."""

    seq: Sequence
    """The sequence whose slot or blocks hold the keys (a group's first sample at admission)."""
    tokens: list[int]
    """The whole prefix the cache holds after the forward (prompt, or prompt + generated but the last)."""
    start: int = 0
    """Leading tokens already in the cache (prefix hits): not recomputed, attended to."""


RoundLen = Callable[[int, int, int], int]
"""``(need, multiple, cap) -> length``: the engine's rounding of a decode read length (exact, or to
CUDA-graph keys: ``cuda_graphs.round_read_len``)."""


@runtime_checkable
class CachePolicy(Protocol):
    """Where an ``Engine``'s keys/values live and which samples run (module docstring).

    The engine calls, per ``step()``: ``scheduler.admit`` -> ``bind_prefill`` / forward /
    ``record_routed`` / ``unbind`` -> ``place_prefill`` -> (``blocks_short`` > 0: ``preempt``) ->
    ``prepare_decode`` -> ``read_len`` / ``bind_decode`` / forward / ``record_routed`` / ``unbind``;
    on finishing ``release`` then (compaction) ``move_rows`` and ``reset_rows``; ``weights_changed``
    after ``update_weights``. Every method runs on the engine's thread between forwards, except
    ``bind_decode`` / ``record_routed`` / ``unbind`` of a decode, which a CUDA graph captures: they
    read only device tensors and never wait for the device.
    """

    kind: str
    """Name of the policy (``"slots"``, ``"paged"``); ``Engine.cache_kind``."""
    kv: Any
    """The model's cache seam object (``moerl.models.layers.KVCache``): ``update`` / ``attn_mask``,
    ``latent``, ``routed`` (the routed-experts buffer or None) and ``ensure_routed(Lm, K)``."""
    scheduler: Scheduler
    """Host admission and the running rows (``running[i].slot == i``)."""
    num_slots: int
    """N, rows of the per-row device state (most sequences running together)."""
    max_seq_len: int
    """Longest sequence (prompt + new tokens) a request may ask for; longer ones are rejected."""
    row_state: list[torch.Tensor]
    """Per-row device tensors ``[N, ...]`` (e.g. a block table) the engine moves with a row."""

    def bind_prefill(self, rows: list[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bind ``kv`` to a prefill of ``rows``; returns its inputs ``ids [R, T]`` int64 (host) and
        ``positions [R, T]`` int64 (device): row r computes ``tokens[start:]``, right-padded."""
        ...

    def record_routed(self, routed: torch.Tensor) -> None:
        """Store the bound forward's routed experts ``[R|B, T, Lm, K]`` beside their keys (R3)."""
        ...

    def unbind(self) -> None:
        """End the bound forward."""
        ...

    def place_prefill(self, admissions: list[Admission]) -> None:
        """After an admission prefill: give each further sample of a group the prompt's keys (a copy or
        shared blocks) and restore what readmitted (``resumed``) sequences had."""
        ...

    def blocks_short(self) -> int:
        """Cache units the next decode step needs beyond the free ones (<= 0: none missing)."""
        ...

    def preempt(self, short: int) -> list[Sequence]:
        """Evict running sequences until ``short`` units are free (never the oldest); they stay in flight
        and are readmitted later. Returns them, still in their rows (the engine removes them)."""
        ...

    def prepare_decode(self, batch_rows: int) -> None:
        """Give each running sequence room for its next token; ``batch_rows`` is the coming decode's B
        (0: nothing runs)."""
        ...

    def read_len(self, seqs: list[Sequence], multiple: int, round_len: RoundLen) -> int:
        """The decode's read length (a CUDA-graph key) for the running ``seqs``."""
        ...

    def decode_variant(self) -> tuple:
        """What else decides the decode step's Python path (part of its CUDA-graph key)."""
        ...

    def bind_decode(self, num_rows: int, positions: torch.Tensor, read_len: int) -> None:
        """Bind ``kv`` to a one-token decode of rows 0..B-1 at ``positions [B]`` (device; no host sync)."""
        ...

    def routed_records(self, seq: Sequence, length: int) -> torch.Tensor:
        """``[length, Lm, K]`` int32 routed experts of ``seq``'s first ``length`` cached tokens."""
        ...

    def release(self, seqs: list[Sequence]) -> None:
        """Free what finished (or cancelled) ``seqs`` hold in the cache."""
        ...

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Compaction moves row ``src[i]`` to ``dst[i]`` (the running sequences are already renumbered)."""
        ...

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Rows ``[n]`` int64 became free."""
        ...

    def weights_changed(self) -> None:
        """The model's weights changed: cached keys/values no longer match a fresh prefill."""
        ...

    def capacity(self) -> tuple[int, int, int]:
        """``(kv_tokens, blocks_total, blocks_used)`` for ``EngineStats`` (a slot counts as a block)."""
        ...


def right_padded(rows: list[list[int]]) -> torch.Tensor:
    """``[R, T]`` int64 (host) of token lists right-padded with 0 to the longest."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
    for r, toks in enumerate(rows):
        ids[r, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
    return ids
