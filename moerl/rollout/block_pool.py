"""Block bookkeeping of the paged KV cache: a free list, reference counts, a hash index of full blocks.

No tensors here (the engine owns the device memory, ``paged_kv_cache.PagedKVCache``). A block holds
``block_size`` consecutive tokens of one or more sequences; a sequence's block table lists its blocks in
order. A block is shared (reference count > 1) when several sequences have the same tokens there: the
samples of a group share their prompt's full blocks, and prompts with a common preamble share the full
blocks of that preamble, found through the hash index.

Hash index (as vLLM's prefix caching): full block i of a token sequence has the chained hash
``h_i = hash((h_{i-1}, tokens of block i))`` (h_{-1} = 0), so equal hashes mean equal whole prefixes. A
hit is verified against the block's stored tokens and its parent hash. A freed block keeps its hash
(its keys/values stay valid) until it is reallocated, so a later request with the same prefix can
still hit it; the free list hands out the least recently freed block first.
"""

from __future__ import annotations

from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them)."""
    out: list[int] = []
    parent = 0
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` KV blocks: free list, reference counts and the hash index of full blocks.

    Args:
        num_blocks: blocks in the pool (block ids 0..num_blocks-1).
        block_size: tokens per block.

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = LRU order
        self._hash: list[int | None] = [None] * num_blocks
        self._key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (parent hash, tokens)
        self.has_routed = [False] * num_blocks
        """Block's routed-experts records were written (only such blocks serve an R3 request's hit)."""
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0 (some may still be indexed)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A fresh block (reference count 1), the least recently freed one; its old hash is forgotten.

        Raises:
            RuntimeError: no free block (the scheduler checks ``num_free`` first).
        """
        if not self._free:
            raise RuntimeError("BlockPool.allocate: no free block")
        block = next(iter(self._free))
        del self._free[block]
        self._unindex(block)
        self.has_routed[block] = False
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference to ``block`` (a prefix hit or a group's shared prompt block)."""
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at 0 the block is free (and stays indexed until reallocated)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"BlockPool.release: block {block} is not referenced")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._free[block] = None

    def lookup(self, h: int, parent: int, tokens: tuple[int, ...]) -> int | None:
        """The indexed block whose chained hash is ``h`` and whose key is (parent, tokens), or None."""
        block = self._by_hash.get(h)
        if block is None or self._key[block] != (parent, tokens):
            return None
        return block

    def index(self, block: int, h: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Enter a full block under its chained hash (a later equal prefix will hit it)."""
        self._unindex(block)
        old = self._by_hash.get(h)
        if old is not None:
            self._hash[old], self._key[old] = None, None
        self._by_hash[h] = block
        self._hash[block], self._key[block] = h, (parent, tokens)

    def clear_index(self) -> None:
        """Forget every hash (the weights changed: cached keys/values no longer match a fresh prefill)."""
        self._by_hash.clear()
        self._hash = [None] * self.num_blocks
        self._key = [None] * self.num_blocks

    def _unindex(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            if self._by_hash.get(h) == block:
                del self._by_hash[h]
            self._hash[block], self._key[block] = None, None
