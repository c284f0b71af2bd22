"""The rollout engine over a paged KV cache: memory bounded by the tokens sequences hold, not by slots.

Shapes: N = ``max_slots`` rows, A running sequences (rows 0..A-1), B decode rows, W blocks read per
decode row, M = max blocks per sequence, bs block size, Lm MoE layers, K top-k.

Same step as ``Engine`` (admit and prefill, decode, sync) with the paged pieces:
  - ``PagedScheduler`` admits by free blocks and shares prefixes (a group's prompt is prefilled once and
    its full blocks shared; full blocks already in the cache are hits and not recomputed);
  - before each decode, a sequence whose next token starts a block gets one; when blocks run out the
    youngest sequences are preempted (host sync first, so their tokens are known) and later readmitted
    with a prefill of what they had (tokens and log-probs already produced are kept);
  - the decode step reads each row's keys through the block table ``[N, M]`` (device tensor, padded
    with the null block), with fixed shapes per (B, W) key and no host sync: CUDA-graph capturable.
    Where the Triton kernel attends (it reads each row's own length), W is M always: keys by B (and the
    step's flags), not by lengths.

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
from moerl.rollout.engine import Engine
from moerl.rollout.kv_cache import KVLayout, kv_layout
from moerl.rollout.paged_attention import PrefixGroups, prefix_group_rows, prefix_max_groups
from moerl.rollout.paged_kv_cache import PagedKVCache, paged_geometry
from moerl.rollout.paged_scheduler import PagedAdmission, PagedScheduler
from moerl.rollout.params import Completion
from moerl.rollout.sampler import sample_key, sample_no_sync
from moerl.rollout.scheduler import Sequence
from moerl.rollout.stats import EngineStats


class PagedEngine(Engine):
    """``Engine`` with a paged KV cache, prefix sharing and preemption (module docstring).

    Args:
        model: as ``Engine``.
        max_slots: most sequences decoding together (rows of the block table).
        kv_token_budget: KV cache capacity in tokens (``kv_token_budget // block_size`` blocks, at most
            what ``max_slots`` sequences of the model's context fill); one sequence may use all of it, up
            to the model's ``max_position_embeddings``.
        block_size: tokens per cache block.
        max_prefill_tokens: tokens computed by the prefills of one step (at least one admission).
        max_stop_tokens, sync_every, batch_buckets, seed, version, kv_layout_override, cuda_graphs,
            mla_cache, overlap_sync: as ``Engine``.
        attn_len_multiple: the decode read length is rounded up to a multiple of this (in whole blocks).

    Raises:
        ValueError: sizes that leave no room for a sequence of two tokens; a non-positive setting; an
            unknown ``mla_cache``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_slots: int = 64,
        kv_token_budget: int = 16384,
        block_size: int = 16,
        max_prefill_tokens: int = 4096,
        max_stop_tokens: int = 8,
        sync_every: int | None = None,
        batch_buckets: tuple[int, ...] | None = None,
        attn_len_multiple: int = 64,
        seed: int = 0,
        version: int = 0,
        kv_layout_override: KVLayout | None = None,
        cuda_graphs: bool = True,
        mla_cache: str = "latent",
        overlap_sync: bool | None = None,
    ) -> None:
        cfg = model.config
        if block_size < 1 or max_slots < 1:
            raise ValueError(f"block_size={block_size} and max_slots={max_slots} must be >= 1")
        num_blocks, max_len = paged_geometry(
            kv_token_budget, block_size, cfg.max_position_embeddings, max_slots
        )
        if max_len < 2:
            raise ValueError(
                f"kv_token_budget={kv_token_budget}, block_size={block_size} leave no room for a sequence of "
                f"2 tokens (model context {cfg.max_position_embeddings})"
            )
        param = self._init_common(
            model,
            max_len,
            max_stop_tokens,
            sync_every,
            max_prefill_tokens,
            batch_buckets,
            attn_len_multiple,
            version,
        )
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        """M, block-table width: blocks of the longest sequence."""
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(
            kv_layout_override or kv_layout(cfg, mla_cache),
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=param.dtype,
            device=self.device,
        )
        self.scheduler = PagedScheduler(max_slots, max_prefill_tokens, self.pool)
        self._init_state(max_slots, seed, cuda_graphs, overlap_sync)
        self._block_table = torch.full(
            (max_slots, self.max_blocks), self.cache.null_block, dtype=torch.int64, device=self.device
        )
        self._slot_state.append(self._block_table)  # moved with its row on compaction
        # rows sharing a group's prompt blocks: read once per group by the kernel (``_prefix_groups``)
        self._prefix: PrefixGroups | None = None
        if self.cache.decode_reads_own_length and os.environ.get("MOERL_PAGED_PREFIX", "1") != "0":
            gr = prefix_group_rows(cfg.num_attention_heads // self.cache.layout.num_kv_heads)
            zeros = lambda *shape, dt=torch.int64: torch.zeros(shape, dtype=dt, device=self.device)  # noqa: E731
            self._prefix = PrefixGroups(
                leaders=torch.full(
                    (prefix_max_groups(max_slots),), -1, dtype=torch.int64, device=self.device
                ),
                n=zeros(max_slots, dt=torch.int32),
                length=zeros(max_slots),
                rows=zeros(max_slots, gr),
                start=zeros(max_slots),
            )
        self._groups_stale = True
        self._has_groups = False  # some running rows share blocks now: the decode runs the group pass

    @classmethod
    def from_config(cls, model, cfg, *, seed: int = 0, version: int = 0) -> PagedEngine:
        """A paged engine sized by the run config's ``RolloutConfig`` (``max_slots`` caps the sequences
        decoding together, ``kv_token_budget`` the cache, ``kv_block_size`` its blocks)."""
        return cls(
            model,
            max_slots=cfg.max_slots,
            kv_token_budget=cfg.kv_token_budget,
            block_size=cfg.kv_block_size,
            max_prefill_tokens=cfg.max_prefill_tokens,
            sync_every=cfg.sync_every,
            seed=seed,
            version=version,
            mla_cache=cfg.mla_cache,
            overlap_sync=None if cfg.overlap_sync else False,
        )

    @property
    def num_slots(self) -> int:
        """N, most sequences decoding together."""
        return self.scheduler.num_slots

    @property
    def stats(self) -> EngineStats:
        """Blocks, preemptions, prefill and prefix-hit tokens, decode batch sizes (``EngineStats``)."""
        sched = self.scheduler
        return EngineStats(
            kv_tokens=self.pool.num_blocks * self.block_size,
            kv_tokens_used=sum(s.seq_len for s in sched.running),
            blocks_total=self.pool.num_blocks,
            blocks_used=self.pool.num_used,
            running=len(sched.running),
            prefill_tokens=sched.prefill_tokens,
            decode_steps=self._decode_steps,
            decode_rows=self._decode_rows,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            preemptions=sched.num_preemptions,
        )

    def update_weights(self, named_tensors, version: int) -> None:
        """``Engine.update_weights``; the prefix index is cleared (cached blocks hold old keys/values,
        which running sequences keep using but new requests must not hit)."""
        super().update_weights(named_tensors, version)
        self.pool.clear_index()

    # -- Admission and prefill ------------------------------------------------------------------

    def _admit(self) -> list[PagedAdmission]:
        return self.scheduler.admit(sample_key)

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
        if self.device.type == "cuda":
            dev = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = host.to(self.device)
        self._block_table.index_put_((dev[0], dev[1]), dev[2])

    def _forward_prefixes(
        self, blocks: list[list[int]], tokens: list[list[int]], starts: list[int], want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill forward: row r computes ``tokens[r][starts[r]:]`` into its blocks, attending over
        its whole prefix. Returns the logits [R, T, V] and the token slots written [R, T] (padding ->
        the null block)."""
        dev = self.device
        ends = [len(t) for t in tokens]
        t = max(e - s for s, e in zip(starts, ends, strict=True))
        ids = torch.zeros(len(tokens), t, dtype=torch.int64)
        pos = torch.zeros(len(tokens), t, dtype=torch.int64)
        for r, (toks, s, e) in enumerate(zip(tokens, starts, ends, strict=True)):
            ids[r, : e - s] = torch.tensor(toks[s:e], dtype=torch.int64)
            pos[r] = (s + torch.arange(t)).clamp(max=e - 1)
        self.cache.bind_prefill(blocks, starts, ends)
        out = self.model(ids.to(dev), None, pos.to(dev), cache=self.cache, return_routed_experts=want_routed)
        write = self.cache.write_slots
        self.cache.unbind()
        if want_routed:
            routed = out.routed_experts  # [R, T, Lm, K]
            buf = self.cache.ensure_routed(routed.shape[2], routed.shape[3])
            buf[write] = routed.to(torch.int32)
            bs = self.block_size
            for bl, s in zip(blocks, starts, strict=True):
                for b in bl[s // bs :]:
                    self.pool.has_routed[b] = True
        return out.logits, write

    def _prefill(self, admissions: list[PagedAdmission]) -> None:
        self._groups_stale = True  # new rows
        dev = self.device
        want_routed = any(a.request.params.return_routed_experts for a in admissions)
        starts = [a.cached for a in admissions]
        logits, _ = self._forward_prefixes(
            [a.sequences[0].blocks for a in admissions], [a.tokens for a in admissions], starts, want_routed
        )
        for a in admissions:
            self.cache.copy_blocks([c[0] for c in a.copies], [c[1] for c in a.copies])
        all_seqs = [s for a in admissions for s in a.sequences]
        self._set_tables(all_seqs)
        slot_all = torch.tensor([s.slot for s in all_seqs], dtype=torch.int64, device=dev)
        self._set_slot_params(all_seqs, slot_all)
        self._active[slot_all] = 1
        resumed = [a.sequences[0] for a in admissions if a.resumed]
        if resumed:
            self._resume(resumed, {id(a.sequences[0]): a.cached for a in admissions if a.resumed})
        fresh = [(r, a) for r, a in enumerate(admissions) if not a.resumed]
        if not fresh:
            return
        n_new = torch.tensor([len(a.tokens) - a.cached for a in admissions], device=dev)
        last = logits[torch.arange(len(admissions), device=dev), n_new - 1]  # [R, V]
        seqs: list[Sequence] = []
        rows: list[int] = []
        for r, a in fresh:
            seqs += a.sequences
            rows += [r] * len(a.sequences)
        slot_idx = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev)
        rows_t = torch.tensor(rows, device=dev)
        prompt_len = torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64, device=dev)
        tokens, logprobs = sample_no_sync(last[rows_t], self._rows(slot_idx, seqs), prompt_len)
        self._last_token[slot_idx] = tokens
        self._seq_len[slot_idx] = prompt_len + 1
        self._record(seqs, tokens, logprobs)

    def _resume(self, seqs: list[Sequence], cached: dict[int, int]) -> None:
        """Device state of readmitted sequences: their last token is the next decode input."""
        dev = self.device
        idx = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev)
        self._last_token[idx] = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64, device=dev)
        self._seq_len[idx] = torch.tensor([s.seq_len for s in seqs], dtype=torch.int64, device=dev)
        for s in seqs:
            if s.saved_routed is not None and self.cache.routed is not None:
                n, c = s.seq_len - 1, cached[id(s)]
                slots = self.cache.token_slots(s.blocks, n)[c:]
                self.cache.routed[slots] = s.saved_routed[c:n].to(self.device)
            s.saved_routed = None

    def _reprefill(self, seqs: list[Sequence]) -> None:
        """Recompute every cached position of ``seqs`` into their blocks (``weight_update.reprefill``)."""
        want_routed = any(s.request.params.return_routed_experts for s in seqs)
        tokens = [list(s.request.prompt_ids) + s.token_ids[:-1] for s in seqs]
        self._forward_prefixes([s.blocks for s in seqs], tokens, [0] * len(seqs), want_routed)

    # -- Decode ---------------------------------------------------------------------------------

    def _reserve_decode(self) -> list[Completion]:
        """Give each running sequence the block its next token needs, preempting the youngest when
        blocks run out (after a host sync of pending tokens, which may finish some and free theirs)."""
        done: list[Completion] = []
        sched = self.scheduler
        while sched.running and sched.blocks_short() > 0:
            if self._pending:
                done += self._sync()
                continue
            victims = sched.preempt(sched.blocks_short(), self._save_routed)
            self._vacate(victims, sched.remove(victims))
            if sched.blocks_short() > 0:
                raise RuntimeError(
                    f"paged KV cache: {sched.blocks_short()} blocks short with one sequence running; "
                    "a request longer than the cache was admitted"
                )
        self._set_tables(sched.grow(), last_only=True)
        if self._groups_stale and self._prefix is not None:
            self._prefix_groups()
        return done

    def _prefix_groups(self) -> None:
        """Write ``_prefix`` for the running rows: rows whose block lists start with the same blocks
        (a group's samples: their prompt's full blocks, shared at admission or found in the prefix index)
        form groups of at most GR rows, each with the leading blocks all its members hold, below the
        position every member writes now; the largest ``prefix_max_groups(B)`` of them (B the decode
        batch) are named to the kernel, in its group slots. Host work when the rows change (admission,
        release, preemption), one host-to-device copy per tensor."""
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
        running = len(self.scheduler.running)
        slots = prefix_max_groups(self._bucket(running)) if running else 0
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
        pinned = self.device.type == "cuda"
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

    def _decode_variant(self) -> tuple:
        """Whether the decode runs the shared-prefix pass (no group: the kernel alone, as without)."""
        return (self._has_groups,)

    def _save_routed(self, seq: Sequence) -> None:
        if seq.request.params.return_routed_experts and self.cache.routed is not None:
            slots = self.cache.token_slots(seq.blocks, seq.seq_len - 1)
            seq.saved_routed = self.cache.routed[slots].cpu()

    def _read_len(self, seqs: list[Sequence]) -> int:
        """W, blocks of the table each decode row is bound to: M when the kernel attends
        (``PagedKVCache.decode_reads_own_length``: each row reads its own length only, so one W serves
        every step and CUDA graphs are keyed by B alone); else the longest sequence's, rounded up to whole
        multiples of ``attn_len_multiple`` tokens (with CUDA graphs also to four keys per doubling), capped
        at M (a CUDA-graph key)."""
        if self.cache.decode_reads_own_length:
            return self.max_blocks
        bs = self.block_size
        mult = max(1, self.attn_len_multiple // bs)
        need = -(-max(s.seq_len for s in seqs) // bs)
        return self._round_read_len(need, mult, self.max_blocks)

    def _decode_forward_no_sync(self, b: int, read_len: int, rows, want_routed: bool):
        """One decode forward of rows 0..b-1 over ``read_len`` blocks each (as ``Engine``'s: reads only
        preallocated device state, no host sync)."""
        seq_len = self._seq_len[:b]
        pos = seq_len - 1
        p = self._prefix if self._has_groups else None
        groups = None
        if p is not None:
            groups = PrefixGroups(
                p.leaders[: prefix_max_groups(b)], p.n[:b], p.length[:b], p.rows[:b], p.start[:b]
            )
        self.cache.bind_decode(self._block_table[:b, :read_len], pos, groups)
        out = self.model(
            self._last_token[:b, None],
            None,
            pos[:, None],
            cache=self.cache,
            return_routed_experts=want_routed,
        )
        write = self.cache.write_slots[:, 0]
        self.cache.unbind()
        if want_routed:
            routed = out.routed_experts  # [B, 1, Lm, K]
            buf = self.cache.ensure_routed(routed.shape[2], routed.shape[3])
            buf[write] = routed[:, 0].to(torch.int32)
        return sample_no_sync(out.logits[:, -1], rows, seq_len)

    # -- Completion and release -----------------------------------------------------------------

    def _completion(self, seq: Sequence) -> Completion:
        routed = None
        if seq.request.params.return_routed_experts and self.cache.routed is not None:
            n = seq.prompt_len + len(seq.token_ids) - 1
            routed = self.cache.routed[self.cache.token_slots(seq.blocks, n)].to("cpu", torch.int64)
        return Completion(
            request_id=seq.request.request_id,
            sample_index=seq.sample_index,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            policy_versions=seq.policy_versions,
            routed_experts=routed,
        )

    def _release(self, finished: list[Sequence]) -> None:
        for seq in finished:
            for b in seq.blocks:
                self.pool.release(b)
            seq.blocks = []
        super()._release(finished)

    def _reset_slots(self, idx: torch.Tensor) -> None:
        super()._reset_slots(idx)
        self._block_table[idx] = self.cache.null_block
        self._groups_stale = True  # rows left or moved (release, preemption, compaction)

    def _move_cache(self, src: list[int], dst: list[int]) -> None:
        pass  # a row's blocks stay where they are; its block-table row moves with the slot state

    def _drop_waiting(self) -> None:
        self.scheduler.drop_all()
