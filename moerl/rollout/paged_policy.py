"""The paged cache policy: memory bounded by the tokens sequences hold, not by slots (``rollout.kv_cache:
paged``, the run default).

Shapes: N = ``max_slots`` rows, A running sequences (rows 0..A-1), B decode rows, W blocks read per
decode row, M = max blocks per sequence, bs block size, Lm MoE layers, K top-k.

  - ``PagedScheduler`` admits by free blocks and shares prefixes (a group's prompt is prefilled once and
    its full blocks shared; full blocks already in the cache are hits and not recomputed);
  - before each decode, a sequence whose next token starts a block gets one; when blocks run out the
    engine preempts the youngest sequences (``preempt``, after a host sync so their tokens are known);
    they are later readmitted with a prefill of what they had (tokens and log-probs already produced
    are kept);
  - the decode step reads each row's keys through the block table ``[N, M]`` (device tensor, padded
    with the null block; a ``row_state`` tensor, so it moves with its row), with fixed shapes per
    (B, W) key and no host sync: CUDA-graph capturable. Where the Triton kernel attends (it reads each
    row's own length), W is M always: keys by B (and the step's flags), not by lengths.

Shared prompts in decode: rows whose block tables start with the same blocks (a group's samples) are
named to the kernel as groups (``paged_attention.PrefixGroups``), which reads those blocks once per group
instead of once per row (cascade attention); ``MOERL_PAGED_PREFIX=0`` turns that off (every row reads its
own keys whole; the same attention).

R3: routed experts are kept per cached token beside the keys (``PagedKVCache.routed``); a preempted
sequence's records are saved on the host and written back on readmission (positions not shared), so a
completion's records are those of the forwards that produced its tokens.
"""

from __future__ import annotations

import os

import torch

from moerl.rollout.block_pool import BlockPool
from moerl.rollout.cache_policy import CacheSpec, PrefillRow, RoundLen, right_padded
from moerl.rollout.paged_attention import PrefixGroups, prefix_group_rows, prefix_max_groups
from moerl.rollout.paged_kv_cache import PagedKVCache, paged_geometry
from moerl.rollout.paged_scheduler import PagedAdmission, PagedScheduler
from moerl.rollout.scheduler import Sequence

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block when ``CacheSpec.block_size`` is None (``rollout.kv_block_size``'s default)."""


class PagedCachePolicy:
    """``CachePolicy`` over ``PagedKVCache`` with prefix sharing and preemption (module docstring).

    Args:
        spec: ``kv_token_budget // block_size`` blocks (at most what ``max_slots`` sequences of the
            model's context fill, ``paged_kv_cache.paged_geometry``); one sequence may use all of it, up to
            the model's context; at most ``max_slots`` rows decode together.

    Raises:
        ValueError: ``block_size`` or ``max_slots`` below 1; sizes that leave no room for a sequence of two
            tokens; ``max_seq_len`` given (a paged sequence may use the whole cache).
    """

    kind = "paged"

    def __init__(self, spec: CacheSpec) -> None:
        bs = DEFAULT_BLOCK_SIZE if spec.block_size is None else spec.block_size
        if bs < 1 or spec.max_slots < 1:
            raise ValueError(f"block_size={bs} and max_slots={spec.max_slots} must be >= 1")
        if spec.max_seq_len is not None:
            raise ValueError(
                f"max_seq_len={spec.max_seq_len} applies to the slot cache; a paged sequence may use the "
                "whole cache (size it with kv_token_budget)"
            )
        num_blocks, max_len = paged_geometry(spec.kv_token_budget, bs, spec.context, spec.max_slots)
        if max_len < 2:
            raise ValueError(
                f"kv_token_budget={spec.kv_token_budget}, block_size={bs} leave no room for a sequence of "
                f"2 tokens (model context {spec.context})"
            )
        self.block_size = bs
        self.max_seq_len = max_len
        self.max_blocks = -(-max_len // bs)
        """M, block-table width: blocks of the longest sequence."""
        self.num_slots = spec.max_slots
        self.pool = BlockPool(num_blocks, bs)
        self.kv = PagedKVCache(
            spec.layout, num_blocks=num_blocks, block_size=bs, dtype=spec.dtype, device=spec.device
        )
        self.scheduler = PagedScheduler(spec.max_slots, spec.max_prefill_tokens, self.pool)
        self._device = spec.device
        self._block_table = torch.full(
            (spec.max_slots, self.max_blocks), self.kv.null_block, dtype=torch.int64, device=spec.device
        )
        self.row_state = [self._block_table]  # moved with its row on compaction
        self._prefix = self._prefix_buffers(spec)
        self._groups_stale = True
        self._has_groups = False  # some running rows share blocks now: the decode runs the group pass
        self._prefill_blocks: tuple[list[list[int]], list[int]] | None = None  # of a bound prefill (R3)

    def _prefix_buffers(self, spec: CacheSpec) -> PrefixGroups | None:
        """Device buffers naming rows that share a group's prompt blocks to the kernel (``_prefix_groups``),
        or None where the kernel does not attend (or ``MOERL_PAGED_PREFIX=0``)."""
        if not self.kv.decode_reads_own_length or os.environ.get("MOERL_PAGED_PREFIX", "1") == "0":
            return None
        n = spec.max_slots
        gr = prefix_group_rows(spec.num_attention_heads // spec.layout.num_kv_heads)
        zeros = lambda *shape, dt=torch.int64: torch.zeros(shape, dtype=dt, device=spec.device)  # noqa: E731
        return PrefixGroups(
            leaders=torch.full((prefix_max_groups(n),), -1, dtype=torch.int64, device=spec.device),
            n=zeros(n, dt=torch.int32),
            length=zeros(n),
            rows=zeros(n, gr),
            start=zeros(n),
        )

    # -- Prefill ------------------------------------------------------------------------------------

    def bind_prefill(self, rows: list[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Row r computes ``tokens[start:]`` into its sequence's blocks, attending over its whole prefix;
        padded positions repeat the row's last position and write to the null block."""
        blocks = [r.seq.blocks for r in rows]
        starts = [r.start for r in rows]
        ends = [len(r.tokens) for r in rows]
        ids = right_padded([r.tokens[r.start :] for r in rows])
        t = ids.shape[1]
        pos = torch.zeros(len(rows), t, dtype=torch.int64)
        for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
            pos[r] = (s + torch.arange(t)).clamp(max=e - 1)
        self.kv.bind_prefill(blocks, starts, ends)
        self._prefill_blocks = (blocks, starts)
        return ids, pos.to(self._device)

    def record_routed(self, routed: torch.Tensor) -> None:
        """Into the token slots the bound forward wrote; a prefill marks its blocks as carrying records
        (only such blocks serve an R3 request's prefix hit)."""
        buf = self.kv.ensure_routed(routed.shape[2], routed.shape[3])
        buf[self.kv.write_slots] = routed.to(torch.int32)
        if self._prefill_blocks is not None:
            bs = self.block_size
            for bl, s in zip(*self._prefill_blocks, strict=True):
                for b in bl[s // bs :]:
                    self.pool.has_routed[b] = True

    def unbind(self) -> None:
        self.kv.unbind()
        self._prefill_blocks = None

    def place_prefill(self, admissions: list[PagedAdmission]) -> None:
        """Copy-on-write copies of partial prompt blocks, the new rows' block tables, and the saved routed
        records of readmitted sequences (past their prefix hits)."""
        self._groups_stale = True  # new rows
        for a in admissions:
            self.kv.copy_blocks([c[0] for c in a.copies], [c[1] for c in a.copies])
        self._set_tables([s for a in admissions for s in a.sequences])
        for a in admissions:
            seq = a.sequences[0]
            if not a.resumed:
                continue
            if seq.saved_routed is not None and self.kv.routed is not None:
                n, c = seq.seq_len - 1, a.cached
                slots = self.kv.token_slots(seq.blocks, n)[c:]
                self.kv.routed[slots] = seq.saved_routed[c:n].to(self._device)
            seq.saved_routed = None

    def _set_tables(self, seqs: list[Sequence], *, last_only: bool = False) -> None:
        """Write the block-table entries of ``seqs``: all their blocks, or (``last_only``) the newest.

        One host-to-device copy of the (row, column, block) triples, from pinned memory without waiting
        for the device on CUDA: decode steps that give sequences new blocks stay free of host syncs.
        """
        triples = [
            (s.slot, j, s.blocks[j])
            for s in seqs
            for j in range(len(s.blocks) - 1 if last_only else 0, len(s.blocks))
        ]
        if not triples:
            return
        host = torch.tensor(triples, dtype=torch.int64).T.contiguous()  # [3, n]
        if self._device.type == "cuda":
            dev = host.pin_memory().to(self._device, non_blocking=True)
        else:
            dev = host.to(self._device)
        self._block_table.index_put_((dev[0], dev[1]), dev[2])

    # -- Decode -------------------------------------------------------------------------------------

    def blocks_short(self) -> int:
        return self.scheduler.blocks_short()

    def preempt(self, short: int) -> list[Sequence]:
        """The youngest running sequences (``PagedScheduler.preempt``), their routed records saved."""
        return self.scheduler.preempt(short, self._save_routed)

    def _save_routed(self, seq: Sequence) -> None:
        if seq.request.params.return_routed_experts and self.kv.routed is not None:
            slots = self.kv.token_slots(seq.blocks, seq.seq_len - 1)
            seq.saved_routed = self.kv.routed[slots].cpu()

    def prepare_decode(self, batch_rows: int) -> None:
        """A block for each sequence whose next token starts one; the shared-prefix groups when rows
        changed."""
        self._set_tables(self.scheduler.grow(), last_only=True)
        if self._groups_stale and self._prefix is not None:
            self._prefix_groups(batch_rows)

    def room_for_drafts(self, seq: Sequence, num_drafts: int) -> int:
        """Give ``seq`` the blocks that ``num_drafts`` drafted positions after its next one need (free
        blocks only, never a preemption); returns how many drafts fit (speculative decoding,
        ``moerl.rollout.spec_decode``). Blocks past the length stay the sequence's, used as it grows."""
        bs = self.block_size
        need = -(-(seq.seq_len + num_drafts) // bs) - len(seq.blocks)  # positions up to seq_len - 1 + n
        grown = min(max(need, 0), self.pool.num_free)
        for _ in range(grown):
            seq.blocks.append(self.pool.allocate())
        if grown:
            self._set_tables([seq])
            self._groups_stale = True
        return min(num_drafts, len(seq.blocks) * bs - seq.seq_len)

    def _prefix_groups(self, batch_rows: int) -> None:
        """Write ``_prefix`` for the running rows: rows whose block lists start with the same blocks
        (a group's samples: their prompt's full blocks, shared at admission or found in the prefix index)
        form groups of at most GR rows, each with the leading blocks all its members hold, below the
        position every member writes now; the largest ``prefix_max_groups(B)`` of them (B =
        ``batch_rows``) are named to the kernel, in its group slots. Host work when the rows change
        (admission, release, preemption), one host-to-device copy per tensor."""
        p, bs = self._prefix, self.block_size
        n_slots, gr = p.rows.shape
        n, length, start = [0] * n_slots, [0] * n_slots, [0] * n_slots
        rows = [[0] * gr for _ in range(n_slots)]
        leaders = [-1] * p.leaders.shape[0]
        by_first: dict[int, list[Sequence]] = {}
        for s in self.scheduler.running:
            if len(s.blocks) > 1:
                by_first.setdefault(s.blocks[0], []).append(s)
        chunks = [seqs[c : c + gr] for seqs in by_first.values() for c in range(0, len(seqs) - 1, gr)]
        chunks = sorted((c for c in chunks if len(c) > 1), key=len, reverse=True)  # larger groups first
        slots = prefix_max_groups(batch_rows) if batch_rows else 0
        for chunk in chunks:
            if slots == 0:
                break  # no group slot left: these rows read their prompt themselves
            lead = chunk[0].blocks
            limit = min(min(len(s.blocks) - 1, (s.seq_len - 1) // bs) for s in chunk)
            k = 0
            while k < limit and all(s.blocks[k] == lead[k] for s in chunk):
                k += 1
            if k == 0:
                continue
            r = chunk[0].slot
            slots -= 1
            leaders[slots] = r
            n[r], length[r] = len(chunk), k * bs
            rows[r][: len(chunk)] = [s.slot for s in chunk]
            for s in chunk:
                start[s.slot] = k * bs
        pinned = self._device.type == "cuda"
        for dst, host in (
            (p.leaders, torch.tensor(leaders, dtype=torch.int64)),
            (p.n, torch.tensor(n, dtype=torch.int32)),
            (p.length, torch.tensor(length, dtype=torch.int64)),
            (p.rows, torch.tensor(rows, dtype=torch.int64)),
            (p.start, torch.tensor(start, dtype=torch.int64)),
        ):
            dst.copy_(host.pin_memory() if pinned else host, non_blocking=pinned)
        self._groups_stale = False
        self._has_groups = any(n)

    def read_len(self, seqs: list[Sequence], multiple: int, round_len: RoundLen, extra: int = 0) -> int:
        """W, blocks of the table each decode row is bound to: M when the kernel attends
        (``PagedKVCache.decode_reads_own_length``: each row reads its own length only, so one W serves
        every step and CUDA graphs are keyed by B alone); else the longest sequence's, rounded up to
        whole multiples of ``multiple`` tokens (with CUDA graphs also to four keys per doubling), capped
        at M (a CUDA-graph key). ``extra``: positions each row feeds past its next one (a speculative
        verify's drafts)."""
        if self.kv.decode_reads_own_length:
            return self.max_blocks
        bs = self.block_size
        need = -(-(max(s.seq_len for s in seqs) + extra) // bs)
        return round_len(need, max(1, multiple // bs), self.max_blocks)

    def decode_variant(self) -> tuple:
        """Whether the decode runs the shared-prefix pass (no group: the kernel alone, as without)."""
        return (self._has_groups,)

    def bind_decode(self, num_rows: int, positions: torch.Tensor, read_len: int) -> None:
        """Rows 0..B-1 over ``read_len`` blocks of their tables (and the named prefix groups)."""
        b = num_rows
        p = self._prefix if self._has_groups else None
        groups = None
        if p is not None:
            groups = PrefixGroups(
                p.leaders[: prefix_max_groups(b)], p.n[:b], p.length[:b], p.rows[:b], p.start[:b]
            )
        self.kv.bind_decode(self._block_table[:b, :read_len], positions, groups)

    def bind_verify(
        self,
        table_rows: torch.Tensor,
        positions: torch.Tensor,
        is_fed: torch.Tensor,
        read_len: int,
        rows_per_seq: int = 1,
    ) -> None:
        """A speculative verify as a decode of R rows (``moerl.rollout.spec_decode``): row r reads and
        writes through the block-table row ``table_rows[r]`` (several rows share a sequence's) at
        ``positions[r]``; a row that feeds nothing (``is_fed`` False: past its sequence's drafts) gets the
        null block's table, so its write lands there. Device tensors only, fixed shapes: CUDA-graph safe.
        The layers write every row's key/value before attending, so a row sees the rows of its sequence
        at lower positions. Where the kernel attends, a sequence's ``rows_per_seq`` consecutive rows are
        one prefix group (``_verify_groups``): its cached keys are read once for all of them, not once a
        row -- the verify then reads about what one decode step reads.

        Args:
            table_rows: [R] int64 rows of the block table (< B). positions: [R] int64 (< ``read_len`` *
                bs). is_fed: [R] bool. read_len: W blocks read per row. rows_per_seq: k + 1, the rows
                of one sequence (consecutive; its first row at the lowest position).
        """
        table = self._block_table[:, :read_len].index_select(0, table_rows)
        table = torch.where(is_fed[:, None], table, self.kv.null_block)
        self.kv.bind_decode(table, positions, self._verify_groups(positions, rows_per_seq))

    def _verify_groups(self, positions: torch.Tensor, k1: int) -> PrefixGroups | None:
        """The shared-prefix groups of a verify (``bind_verify``): rows s * k1 .. s * k1 + k1 - 1 (one
        sequence) share its full blocks below its first row's position p_s, length floor(p_s / bs) * bs
        keys, attended once by the group's program; each row's own program reads the rest. Sequences past
        ``prefix_max_groups(R)`` slots, or with no full block yet, read all their keys themselves (the same
        attention). Device tensors from ``positions`` only (CUDA-graph safe); None where the kernel does
        not attend, ``MOERL_PAGED_PREFIX=0``, one row a sequence, or k1 above the kernel's rows a group."""
        p = self._prefix
        if p is None or k1 < 2 or k1 > p.rows.shape[1]:
            return None
        r, dev = positions.shape[0], positions.device
        b = r // k1
        ng = prefix_max_groups(r)
        named = min(b, ng)
        first = positions.view(b, k1)[:, 0]  # [b] each sequence's lowest position
        shared = (first // self.block_size) * self.block_size  # [b] keys below every row's own write
        seq = torch.arange(b, device=dev)
        grouped = (seq < named) & (shared > 0)  # [b]
        leader_rows = seq * k1
        leaders = torch.full((ng,), -1, dtype=torch.int64, device=dev)
        leaders[:named] = torch.where(grouped[:named], leader_rows[:named], -1)
        n = torch.zeros(r, dtype=torch.int32, device=dev)
        n[leader_rows] = torch.where(grouped, k1, 0).to(torch.int32)
        length = torch.zeros(r, dtype=torch.int64, device=dev)
        length[leader_rows] = torch.where(grouped, shared, 0)
        rows = torch.zeros(r, p.rows.shape[1], dtype=torch.int64, device=dev)
        rows[leader_rows, :k1] = leader_rows[:, None] + torch.arange(k1, device=dev)
        start = torch.where(grouped, shared, 0).repeat_interleave(k1)
        return PrefixGroups(leaders, n, length, rows, start)

    # -- Finishing ----------------------------------------------------------------------------------

    def routed_records(self, seq: Sequence, length: int) -> torch.Tensor:
        return self.kv.routed[self.kv.token_slots(seq.blocks, length)]

    def release(self, seqs: list[Sequence]) -> None:
        """Drop the sequences' block references (a shared block frees with its last holder)."""
        for seq in seqs:
            for b in seq.blocks:
                self.pool.release(b)
            seq.blocks = []

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Nothing to copy: a row's blocks stay where they are; its table row moves (``row_state``)."""

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Point the rows' tables at the null block; the prefix groups are recomputed."""
        self._block_table[rows] = self.kv.null_block
        self._groups_stale = True  # rows left or moved (release, preemption, compaction)

    def weights_changed(self) -> None:
        """Clear the prefix index: cached blocks hold old keys/values, which running sequences keep
        using but new requests must not hit."""
        self.pool.clear_index()

    def capacity(self) -> tuple[int, int, int]:
        """Block tokens in all, blocks, and blocks referenced."""
        return self.pool.num_blocks * self.block_size, self.pool.num_blocks, self.pool.num_used
