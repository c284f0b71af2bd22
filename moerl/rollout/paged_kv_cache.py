"""Paged KV cache: fixed-size token blocks addressed through per-row block tables.

Shapes: L layers, NB blocks (+1 null block), bs tokens per block, H kv heads, Dk/Dv head dims, B rows of
one forward, T new tokens per row, R keys read per row, M = max blocks per sequence, Lm MoE layers,
K top-k.

    k, v:        [L, (NB + 1) * bs, H, Dk|Dv]  token slots; slot s is token s % bs of block s // bs
                 (MLA's latent layout: H = 1, Dk = kv_lora_rank + rope, Dv = 0, ``KVLayout.latent``)
    routed:      [(NB + 1) * bs, Lm, K] int32  routed experts per cached token (allocated on first use)
    block table: [N, M] int64 (the engine's)   row r's j-th block; unused entries hold the null block

Block NB is the null block: never handed out, it absorbs the writes of padded rows and padded prompt
positions, and block-table padding points at it, so every index stays in range with fixed shapes.

The model meets the cache at the same seam as ``SlotKVCache`` (``moerl.models.layers.KVCache``):
attention layer ``i`` calls ``k_all, v_all = cache.update(i, k, v)`` with ``k, v [B, H, T, D]`` and
attends with ``cache.attn_mask [B, 1, T, R]``. ``update`` first writes the forward's keys/values into
their slots (all rows), then gathers each row's R keys through its slot indices; so rows of one prefill
may read blocks that other rows write in the same forward (a shared prefix computed once).

Decode (``bind_decode``) derives every index from device tensors (the block table, positions) with
fixed shapes for a given (B, read blocks) key and no host sync: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from moerl.rollout.kv_cache import KVLayout
from moerl.rollout.paged_attention import (
    PrefixGroups,
    paged_decode_attention,
    paged_decode_kernel_runs,
    paged_decode_write,
)


def paged_geometry(kv_token_budget: int, block_size: int, context: int, max_slots: int) -> tuple[int, int]:
    """``(NB, S)``: blocks of an engine's paged cache and the longest sequence it can hold.

    NB = ``min(kv_token_budget // block_size, max_slots * ceil(context / block_size))`` (no more than
    ``max_slots`` sequences of the model's context can use); S = ``min(NB * block_size, context)`` (one
    sequence may use the whole cache). Either can be too small for a run (S < 2); the engine refuses it.
    """
    bs = max(block_size, 1)
    num_blocks = min(kv_token_budget // bs, max_slots * -(-context // bs))
    return num_blocks, min(num_blocks * bs, context)


class PagedKVCache:
    """Preallocated block-paged KV cache implementing the model's ``update`` / ``attn_mask`` seam.

    Args:
        layout: the model's KV geometry.
        num_blocks: NB usable blocks (one more, the null block, is allocated).
        block_size: bs tokens per block.
        dtype, device: of the cached keys/values (the model's).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        lay = layout
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        n = (num_blocks + 1) * block_size
        self.k = torch.zeros(lay.num_layers, n, lay.num_kv_heads, lay.k_head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(lay.num_layers, n, lay.num_kv_heads, lay.v_head_dim, dtype=dtype, device=device)
        self.routed: torch.Tensor | None = None
        self.attn_mask: torch.Tensor | None = None
        """[B, 1, T, R] bool of the bound forward (True = attend)."""
        self.write_slots: torch.Tensor | None = None
        """[B, T] int64 token slot each new key/value of the bound forward goes to."""
        self._read: torch.Tensor | None = None  # [B, R] int64 token slots each row attends over
        self.fused_decode = False
        """True while a decode is bound whose attention runs in ``decode_attention`` (the paged Triton
        kernel reading keys in place); the model then calls ``decode_attention`` instead of ``update``."""
        self._table: torch.Tensor | None = None  # [B, W] of the bound decode (fused path)
        self._lengths: torch.Tensor | None = None  # [B] keys each row attends (fused path)
        self._prefix: PrefixGroups | None = None  # rows sharing leading blocks (fused path)

    @property
    def latent(self) -> bool:
        """MLA layers store their latent here (``KVLayout.latent``; ``moerl.models.layers.KVCache``)."""
        return self.layout.latent

    # ------------------------------------------------------------------------------------------
    # Binding a forward

    def bind_prefill(self, blocks: list[list[int]], starts: list[int], ends: list[int]) -> None:
        """Prepare a prefill of B rows; row b computes positions ``starts[b]..ends[b]-1`` (right-padded
        to T = max(ends - starts)) and attends over its positions 0..ends[b]-1 (R = max(ends)).

        Positions below ``starts[b]`` must already be in the cache (a prefix hit) or written by another
        row of this forward. Padded positions write to the null block.

        Args:
            blocks: each row's block table (host lists, covering at least ``ends[b]`` tokens).
            starts, ends: [B] host ints, 0 <= start < end.
        """
        bs, dev = self.block_size, self.k.device
        b = len(blocks)
        t = max(e - s for s, e in zip(starts, ends, strict=True))
        r = max(ends)
        width = -(-r // bs)
        table = torch.full((b, width), self.null_block, dtype=torch.int64)
        for i, bl in enumerate(blocks):
            nb = min(len(bl), width)
            table[i, :nb] = torch.tensor(bl[:nb], dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        end = torch.tensor(ends, dtype=torch.int64)
        pos = start[:, None] + torch.arange(t)[None, :]  # [B, T] positions computed
        valid = pos < end[:, None]
        pos = torch.where(valid, pos, 0)
        write = table.gather(1, pos // bs) * bs + pos % bs
        self.write_slots = torch.where(valid, write, self.null_block * bs).to(dev)
        keys = torch.arange(r)
        read = table[:, keys // bs] * bs + keys % bs  # [B, R]
        self._read = read.to(dev)
        qpos = start[:, None] + torch.arange(t)[None, :]
        mask = (keys[None, None, :] <= qpos[:, :, None]) & (keys[None, None, :] < end[:, None, None])
        self.attn_mask = mask[:, None].to(dev)  # [B, 1, T, R]

    def bind_decode(
        self, table: torch.Tensor, positions: torch.Tensor, prefix: PrefixGroups | None = None
    ) -> None:
        """Prepare a one-token decode of B rows from device tensors only (no host sync).

        Args:
            table: [B, W] int64 block tables of the rows (W read blocks; the engine's table sliced).
            positions: [B] int64 where each row's new key/value goes (< W * bs); keys j <= position
                are attended.
            prefix: rows sharing leading blocks, each group's shared keys read once by the kernel
                (``paged_attention.PrefixGroups``); None: every row reads its own.
        """
        bs = self.block_size
        b, w = table.shape
        # the kernel serves per-head keys and values; MLA's latent form attends in its own layer code
        self.fused_decode = self.decode_reads_own_length
        if self.fused_decode:  # the kernel reads the keys in place: no [B, R] slot index
            self._table, self._lengths, self._prefix = table, positions + 1, prefix
        else:
            offsets = torch.arange(bs, device=table.device)
            self._read = (table[:, :, None] * bs + offsets).reshape(b, w * bs)
        blk = table.gather(1, (positions // bs)[:, None])[:, 0]
        self.write_slots = (blk * bs + positions % bs)[:, None]  # [B, 1]
        if self.fused_decode:  # the kernel masks by length; the model's mask is then never read
            self.attn_mask = positions.new_ones((b, 1, 1, 1), dtype=torch.bool)
        else:
            keys = torch.arange(w * bs, device=table.device)
            self.attn_mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, R]

    @property
    def decode_reads_own_length(self) -> bool:
        """Whether a decode attends through the kernel (``paged_decode_kernel_runs``; not MLA's latent
        form), which reads each row's keys up to its own length whatever the table's width W: the engine
        then binds the whole table (one W, CUDA-graph keys by B alone)."""
        return paged_decode_kernel_runs(self.k) and not self.layout.latent

    def unbind(self) -> None:
        """Forget the bound forward (``update`` then raises until the next bind)."""
        self._read, self.write_slots, self.attn_mask = None, None, None
        self._table, self._lengths, self.fused_decode, self._prefix = None, None, False, None

    # ------------------------------------------------------------------------------------------
    # The model's seam

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values of ``layer`` and return the keys/values each row attends to.

        Args:
            layer: attention layer index in [0, L).
            k: [B, H, T, Dk], v: [B, H, T, Dv] after RoPE / norms.
        Returns:
            k_all [B, H, R, Dk], v_all [B, H, R, Dv] (gathered through the block tables).
        Raises:
            RuntimeError: no forward is bound, or the shapes do not match the cache.
        """
        if self._read is None:
            raise RuntimeError("PagedKVCache.update called outside a bound prefill/decode")
        lay = self.layout
        b = k.shape[0]
        self._write(layer, k, v)
        read = self._read
        r = read.shape[1]
        k_all = self.k[layer].index_select(0, read.reshape(-1)).view(b, r, lay.num_kv_heads, lay.k_head_dim)
        v_all = self.v[layer].index_select(0, read.reshape(-1)).view(b, r, lay.num_kv_heads, lay.v_head_dim)
        return k_all.transpose(1, 2), v_all.transpose(1, 2)

    def decode_attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store a fused decode's keys/values of ``layer`` and attend in place (``fused_decode`` is True).

        Args:
            layer: attention layer index in [0, L).
            q: [B, nh, 1, Dk], k: [B, H, 1, Dk], v: [B, H, 1, Dv] after RoPE / norms.
            scale: softmax scale.
        Returns:
            [B, 1, nh * Dv] attention output in q's dtype (``moerl.rollout.paged_attention``).
        Raises:
            RuntimeError: no fused decode is bound, or the shapes do not match the cache.
        """
        if not self.fused_decode:
            raise RuntimeError("PagedKVCache.decode_attention called outside a bound fused decode")
        self._write(layer, k, v)
        out = paged_decode_attention(
            q[:, :, 0],
            self.k[layer],
            self.v[layer],
            self._table,
            self._lengths,
            scale,
            self.block_size,
            prefix=self._prefix,
        )
        return out.flatten(1)[:, None]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy a forward's k [B, H, T, Dk] / v [B, H, T, Dv] into their token slots."""
        lay = self.layout
        if k.shape[1] != lay.num_kv_heads or k.shape[-1] != lay.k_head_dim or v.shape[-1] != lay.v_head_dim:
            raise RuntimeError(
                f"layer {layer}: k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache layout {lay}"
            )
        write = self.write_slots.reshape(-1)
        if self.fused_decode and k.shape[2] == 1:  # a decode step through the kernel: one launch, k and v
            paged_decode_write(self.k[layer], self.v[layer], write, k[:, :, 0], v[:, :, 0])
            return
        # flatten, not reshape(-1, ...): MLA's latent layout has an empty v (Dv = 0)
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).flatten(0, 1).to(self.k.dtype))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).flatten(0, 1).to(self.v.dtype))

    # ------------------------------------------------------------------------------------------
    # Blocks and routed experts

    def ensure_routed(self, num_moe_layers: int, top_k: int) -> torch.Tensor:
        """The routed-experts buffer [(NB + 1) * bs, Lm, K] int32, allocated on first use."""
        if self.routed is None:
            self.routed = torch.zeros(
                self.k.shape[1], num_moe_layers, top_k, dtype=torch.int32, device=self.k.device
            )
        elif self.routed.shape[1:] != (num_moe_layers, top_k):
            raise RuntimeError(
                f"routed experts shape changed: {tuple(self.routed.shape[1:])} -> {(num_moe_layers, top_k)}"
            )
        return self.routed

    def token_slots(self, blocks: list[int], length: int) -> torch.Tensor:
        """[length] int64 token slots (on the cache's device) of positions 0..length-1 of a block table."""
        bs = self.block_size
        pos = torch.arange(length)
        return (torch.tensor(blocks, dtype=torch.int64)[pos // bs] * bs + pos % bs).to(self.k.device)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (keys, values, routed experts) src[i] -> dst[i] (copy-on-write of a shared
        partial block)."""
        if not src:
            return
        bs, dev = self.block_size, self.k.device
        off = torch.arange(bs)
        s = (torch.tensor(src)[:, None] * bs + off).reshape(-1).to(dev)
        d = (torch.tensor(dst)[:, None] * bs + off).reshape(-1).to(dev)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
        if self.routed is not None:
            self.routed[d] = self.routed[s]
