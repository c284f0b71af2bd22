"""Static per-slot KV cache: one contiguous, preallocated key/value region per sequence slot.

Shapes: L layers, N slots, H kv heads, S slot capacity (tokens), Dk/Dv key/value head dims,
B rows of one forward, T new tokens per row, R read length (keys attended to), Lm MoE layers, K top-k.

    k, v:    [L, N, H, S, Dk|Dv]   allocated once; never reallocated (update_weights keeps it)
                                   (MLA's latent layout: H = 1, Dk = kv_lora_rank + rope, Dv = 0)
    routed:  [N, S, Lm, K] int32   routed experts per cached token (allocated on first use)

Why contiguous slots rather than paged blocks: a decode step then reads ``k[l, :B, :, :R]``, a strided view
with a fixed shape for a given (B, R) bucket and no block-table gather, which is what a CUDA graph of the
decode step needs. The engine keeps running sequences in slots 0..A-1 (it moves the last running slot into
a freed one), so the decode batch is always a prefix of the slots. The cost is that each slot reserves
its full capacity S whatever the sequence length.

The model meets the cache at one seam (docs/architecture.md, "KV cache seam"): attention layer ``i`` calls
``k_all, v_all = cache.update(i, k, v)`` with ``k, v [B, H, T, D]`` and attends with ``cache.attn_mask``
``[B, 1, T, R]`` (True = attend). The engine binds the cache to a prefill or a decode before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-layer key/value geometry of a model."""

    num_layers: int
    """L: attention layers (each calls ``cache.update`` once per forward)."""
    num_kv_heads: int
    """H: key/value heads."""
    k_head_dim: int
    """Dk: key head dimension."""
    v_head_dim: int
    """Dv: value head dimension."""
    latent: bool = False
    """MLA's latent cache: H = 1, Dk = ``kv_lora_rank + qk_rope_head_dim`` (the normalized latent c_kv and
    the rotated shared key of each token), Dv = 0; the attention layers read keys only and fold the
    up-projections into the query and the output (``moerl.models.layers.MLAttention``)."""

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token occupies over all layers (keys and values)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * elem


MLA_CACHE_FORMS = ("latent", "expanded")
"""How an engine caches multi-head latent attention (``rollout.mla_cache``): ``latent`` stores each
token's ``kv_lora_rank + qk_rope_head_dim`` values per layer (DeepSeek-V2 Sec. 2.1.2's absorbed
decode), ``expanded`` the per-head keys and values (``num_attention_heads x (qk_nope + qk_rope +
v_head_dim)``: 71x more for DeepSeek-V3, kept as the exactness reference)."""


def is_mla(config: Any) -> bool:
    """Whether a Hugging Face style config is multi-head latent attention (``qk_rope_head_dim`` set)."""
    return bool(getattr(config, "qk_rope_head_dim", None))


def kv_layout(config: Any, mla_cache: str = "latent") -> KVLayout:
    """The KV geometry from a Hugging Face style config (fields as in ``config.json``).

    Multi-head latent attention (DeepSeek-V3: ``qk_rope_head_dim`` present), ``mla_cache="latent"``:
    H = 1, Dk = ``kv_lora_rank + qk_rope_head_dim``, Dv = 0 (``KVLayout.latent``); ``"expanded"``: the
    decompressed keys and values, H = ``num_attention_heads``, Dk = ``qk_nope_head_dim +
    qk_rope_head_dim``, Dv = ``v_head_dim``. Otherwise H = ``num_key_value_heads`` (default
    ``num_attention_heads``) and Dk = Dv = ``head_dim`` (default ``hidden_size // num_attention_heads``).

    Raises:
        ValueError: ``mla_cache`` not in ``MLA_CACHE_FORMS``.
    """
    if mla_cache not in MLA_CACHE_FORMS:
        raise ValueError(f"mla_cache={mla_cache!r}: expected one of {MLA_CACHE_FORMS}")
    heads = config.num_attention_heads
    if is_mla(config) and mla_cache == "latent":
        return KVLayout(
            config.num_hidden_layers, 1, config.kv_lora_rank + config.qk_rope_head_dim, 0, latent=True
        )
    if is_mla(config):
        dk = config.qk_nope_head_dim + config.qk_rope_head_dim
        return KVLayout(config.num_hidden_layers, heads, dk, config.v_head_dim)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(config.num_hidden_layers, kv_heads, head_dim, head_dim)


def cache_geometry(
    max_slots: int, kv_token_budget: int, context: int, max_seq_len: int | None = None
) -> tuple[int, int]:
    """``(N, S)``: the slots and the tokens per slot of an engine's cache (``Engine`` sizes it so).

    S = ``min(max_seq_len or kv_token_budget // max_slots, context)``, N = ``min(max_slots,
    kv_token_budget // S)``. Either can be below what a run needs (S < 2 or N < 1); the engine
    refuses such sizes, the run config checks them at load (``moerl.config_engine``).
    """
    slot_len = min(max_seq_len or kv_token_budget // max(max_slots, 1), context)
    return min(max_slots, kv_token_budget // max(slot_len, 1)), slot_len


def cache_bytes(
    layout: KVLayout,
    num_slots: int,
    capacity: int,
    dtype: torch.dtype,
    routed: tuple[int, int] | None = None,
) -> int:
    """Bytes ``SlotKVCache(layout, num_slots=N, capacity=S, dtype=dtype)`` allocates: keys and values
    ``N * S * layout.bytes_per_token(dtype)``, plus the int32 routed-experts buffer ``[N, S, Lm, K]``
    when ``routed = (Lm, K)`` (an engine that records routed experts, R3)."""
    total = num_slots * capacity * layout.bytes_per_token(dtype)
    if routed is not None:
        total += (
            num_slots * capacity * routed[0] * routed[1] * torch.empty((), dtype=torch.int32).element_size()
        )
    return total


class SlotKVCache:
    """Preallocated per-slot KV cache implementing the model's ``update`` / ``attn_mask`` seam.

    Args:
        layout: the model's KV geometry.
        num_slots: N sequence slots.
        capacity: S tokens per slot.
        dtype, device: of the cached keys/values (the model's).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        lay = layout
        self.layout = layout
        self.num_slots = num_slots
        self.capacity = capacity
        self.k = torch.zeros(
            lay.num_layers, num_slots, lay.num_kv_heads, capacity, lay.k_head_dim, dtype=dtype, device=device
        )
        self.v = torch.zeros(
            lay.num_layers, num_slots, lay.num_kv_heads, capacity, lay.v_head_dim, dtype=dtype, device=device
        )
        self.routed: torch.Tensor | None = None
        self.attn_mask: torch.Tensor | None = None
        """[B, 1, T, R] bool of the bound forward (True = attend)."""
        self._mode: str | None = None
        self._slots: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._rows = 0
        self._read_len = 0

    @property
    def latent(self) -> bool:
        """MLA layers store their latent here (``KVLayout.latent``; ``moerl.models.layers.KVCache``)."""
        return self.layout.latent

    # ------------------------------------------------------------------------------------------
    # Binding a forward

    def bind_prefill(self, slots: torch.Tensor, lengths: torch.Tensor, max_len: int) -> None:
        """Prepare a prefill of B right-padded prompts, token t of row b going to slot ``slots[b]``.

        Keys beyond a prompt's length are written too (padding) but never attended: decode overwrites
        position p before it reads it.

        Args:
            slots: [B] int64 destination slots.
            lengths: [B] int64 prompt lengths (<= max_len), on the cache's device.
            max_len: T, the padded prompt length (<= capacity).
        """
        if max_len > self.capacity:
            raise ValueError(f"prefill of {max_len} tokens exceeds the slot capacity {self.capacity}")
        ar = torch.arange(max_len, device=self.k.device)
        causal = ar[None, :] <= ar[:, None]  # [T, T]: query t sees keys j <= t
        in_prompt = ar[None, :] < lengths[:, None]  # [B, T]
        self.attn_mask = (causal[None] & in_prompt[:, None, :])[:, None]  # [B, 1, T, T]
        self._mode, self._slots, self._rows, self._read_len = "prefill", slots, len(slots), max_len

    def bind_decode(self, num_rows: int, positions: torch.Tensor, read_len: int) -> None:
        """Prepare a one-token decode of slots 0..B-1; row b's token sits at ``positions[b]``.

        Args:
            num_rows: B; the rows are slots 0..B-1.
            positions: [B] int64, where each row's new key/value is written (on the cache's device).
            read_len: R, keys attended to per row (> max position, <= capacity); keys j <= position.
        """
        if read_len > self.capacity:
            raise ValueError(f"read length {read_len} exceeds the slot capacity {self.capacity}")
        ar = torch.arange(read_len, device=self.k.device)
        self.attn_mask = (ar[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, R]
        self._mode, self._positions, self._rows, self._read_len = "decode", positions, num_rows, read_len

    def unbind(self) -> None:
        """Forget the bound forward (``update`` then raises until the next bind)."""
        self._mode, self._slots, self._positions, self.attn_mask = None, None, None, None

    # ------------------------------------------------------------------------------------------
    # The model's seam

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values of ``layer`` and return the keys/values to attend to.

        Args:
            layer: attention layer index in [0, L).
            k: [B, H, T, Dk], v: [B, H, T, Dv] after RoPE / norms.
        Returns:
            k_all [B, H, R, Dk], v_all [B, H, R, Dv] (R = T for a prefill).
        Raises:
            RuntimeError: no forward is bound, or the shapes do not match the cache.
        """
        if self._mode is None:
            raise RuntimeError("SlotKVCache.update called outside a bound prefill/decode")
        lay = self.layout
        if k.shape[1] != lay.num_kv_heads or k.shape[-1] != lay.k_head_dim or v.shape[-1] != lay.v_head_dim:
            raise RuntimeError(
                f"layer {layer}: k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache layout {lay}"
            )
        if self._mode == "prefill":
            t = k.shape[2]
            self.k[layer, self._slots, :, :t] = k.to(self.k.dtype)
            self.v[layer, self._slots, :, :t] = v.to(self.v.dtype)
            return k, v
        b = self._rows
        pos = self._positions.view(b, 1, 1, 1)
        self.k[layer, :b].scatter_(2, pos.expand(b, lay.num_kv_heads, 1, lay.k_head_dim), k.to(self.k.dtype))
        self.v[layer, :b].scatter_(2, pos.expand(b, lay.num_kv_heads, 1, lay.v_head_dim), v.to(self.v.dtype))
        r = self._read_len
        return self.k[layer, :b, :, :r], self.v[layer, :b, :, :r]

    # ------------------------------------------------------------------------------------------
    # Slot management

    def ensure_routed(self, num_moe_layers: int, top_k: int) -> torch.Tensor:
        """The routed-experts buffer [N, S, Lm, K] int32, allocated on first use."""
        if self.routed is None:
            self.routed = torch.zeros(
                self.num_slots, self.capacity, num_moe_layers, top_k, dtype=torch.int32, device=self.k.device
            )
        elif self.routed.shape[2:] != (num_moe_layers, top_k):
            raise RuntimeError(
                f"routed experts shape changed: {tuple(self.routed.shape[2:])} -> {(num_moe_layers, top_k)}"
            )
        return self.routed

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first ``length`` cached tokens (keys, values, routed experts) of slots src -> dst.

        Used to share a prompt's prefill among a request's n samples and to compact running slots.
        """
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, d, :, :length] = self.k[:, s, :, :length]
        self.v[:, d, :, :length] = self.v[:, s, :, :length]
        if self.routed is not None:
            self.routed[d, :length] = self.routed[s, :length]
