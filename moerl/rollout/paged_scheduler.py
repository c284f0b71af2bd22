"""Continuous batching over a paged KV cache: admission by free blocks, shared prefixes, preemption.

Host-side only (``block_pool.BlockPool`` for the blocks); the engine applies the plans to the device.

- Rows: running sequences occupy rows 0..A-1 of the engine's block table (A <= ``max_slots``); when
  sequences leave, the last ones move into the holes (``Scheduler.remove``), moving only a table row.
- Admission, FIFO, preempted sequences first (oldest first), then the waiting queue; the head is never
  skipped. A request is admitted when the blocks it needs are free: its prompt's blocks less the leading
  full blocks found in the hash index (prefix hits), plus, for each further sample of the group, one
  block for its own copy of the partially filled last prompt block (copy-on-write: the samples diverge
  there). A group's samples share one prefill and the prompt's full blocks. When sequences are running,
  one block per admitted sample is kept free as headroom. As many samples as fit are admitted.
- Decode growth (``blocks_short`` / ``grow``): a sequence whose next token starts a block gets one.
  When the free blocks do not suffice, the youngest running sequences are preempted (``preempt``): their
  blocks are released and they wait, ahead of new requests, to be readmitted with a prefill of their
  prompt and the tokens generated so far (all but the last, which the next decode feeds). Their tokens and
  log-probs are kept; the sampler's noise depends only on (seed, sample, position), so later tokens are
  those they would have been.
- Prefix hits stop one token short of a prefix's end (at least its last token is computed: a prompt
  needs its last position's logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.rollout.block_pool import BlockPool, block_hashes
from moerl.rollout.scheduler import Admission, Scheduler, Sequence


@dataclass(kw_only=True, slots=True)
class PagedAdmission(Admission):
    """Samples admitted in this step with one prefill of ``tokens[cached:]`` (``cached`` a multiple of
    the block size)."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    """``(src, dst)`` blocks to copy after the prefill: each further sample's own last prompt block."""


class PagedScheduler(Scheduler):
    """FIFO admission by free blocks into at most ``max_slots`` rows, with preemption.

    Args:
        max_slots: most sequences running (decoding together).
        max_prefill_tokens: tokens computed by the prefills of one step (at least one admission).
        pool: the cache's blocks.
    """

    def __init__(self, max_slots: int, max_prefill_tokens: int, pool: BlockPool) -> None:
        super().__init__(max_slots, max_prefill_tokens)
        self.pool = pool
        self.preempted: list[Sequence] = []
        """Preempted sequences waiting for readmission, oldest first."""
        self._arrivals = 0  # prefill_tokens and prefix_hit_tokens also count readmissions and index hits

    @property
    def num_unfinished(self) -> int:
        """Samples waiting, preempted or running."""
        return sum(self._in_flight.values())

    def running_by_request(self) -> dict[str, list[Sequence]]:
        """The running and preempted sequences of each request id (both in flight, with host-synced
        tokens); a copy, safe to call from another thread."""
        out = super().running_by_request()
        for seq in list(self.preempted):
            out.setdefault(seq.request.request_id, []).append(seq)
        return out

    # -- Admission ------------------------------------------------------------------------------

    def admit(self, noise_key) -> list[Admission]:
        """Readmit preempted sequences, then admit waiting requests, while rows and blocks allow.

        Args:
            noise_key: ``(seed, sample_index) -> int``, the noise key of a sample.
        Returns:
            This step's ``PagedAdmission``s, with blocks allocated and indexed.
        """
        admissions: list[Admission] = []
        computed = 0
        while len(self.running) < self.num_slots:
            if self.preempted:
                seq = self.preempted[0]
                tokens = list(seq.request.prompt_ids) + seq.token_ids[:-1]
                want_routed = seq.request.params.return_routed_experts
                n_want, head = 1, None
            elif self._waiting:
                head = self._waiting[0]
                tokens = list(head.request.prompt_ids)
                want_routed = head.request.params.return_routed_experts
                n_want = min(head.request.params.n - head.next_sample, self.num_slots - len(self.running))
            else:
                break
            hashes, hits = self._prefix_hits(tokens, want_routed)
            new_tokens = len(tokens) - len(hits) * self.pool.block_size
            if admissions and computed + new_tokens > self.max_prefill_tokens:
                break
            take = self._fits(tokens, hits, n_want)
            if take == 0:
                break
            blocks = self._allocate(tokens, hashes, hits, want_routed)
            cached = len(hits) * self.pool.block_size
            if head is None:
                seq = self.preempted.pop(0)
                seq.blocks, seq.slot = blocks, len(self.running)
                self.running.append(seq)
                adm = PagedAdmission(
                    request=seq.request, sequences=[seq], tokens=tokens, cached=cached, resumed=True
                )
            else:
                adm = self._admit_group(head, noise_key, tokens, blocks, cached, take)
            admissions.append(adm)
            computed += new_tokens
            self.prefill_tokens += new_tokens
            self.prefix_hit_tokens += cached + (len(adm.sequences) - 1) * len(tokens)
        return admissions

    def _admit_group(self, head, noise_key, tokens, blocks, cached, take) -> PagedAdmission:
        bs = self.pool.block_size
        full = len(tokens) // bs
        seqs, copies = [], []
        for i in range(head.next_sample, head.next_sample + take):
            if i == head.next_sample:
                own = blocks
            else:
                for b in blocks[:full]:
                    self.pool.share(b)
                own = blocks[:full]
                if len(blocks) > full:  # the partial last prompt block: a copy of its own
                    own = own + [self.pool.allocate()]
                    copies.append((blocks[-1], own[-1]))
            seq = Sequence(
                request=head.request,
                sample_index=i,
                slot=len(self.running),
                noise_key=noise_key(head.seed, i),
                arrival=self._arrivals,
                blocks=own,
            )
            self._arrivals += 1
            self.running.append(seq)
            seqs.append(seq)
        head.next_sample += take
        if head.next_sample == head.request.params.n:
            self._waiting.popleft()
        return PagedAdmission(
            request=head.request, sequences=seqs, tokens=tokens, cached=cached, copies=copies
        )

    def _prefix_hits(self, tokens: list[int], want_routed: bool) -> tuple[list[int], list[int]]:
        """Chained hashes of the full blocks of ``tokens`` and the leading indexed blocks that match
        (at most ``(len - 1) // bs``; for an R3 request only blocks with routed-experts records)."""
        bs, pool = self.pool.block_size, self.pool
        hashes = block_hashes(tokens, bs)
        hits: list[int] = []
        parent = 0
        for i in range((len(tokens) - 1) // bs):
            block = pool.lookup(hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None or (want_routed and not pool.has_routed[block]):
                break
            hits.append(block)
            parent = hashes[i]
        return hashes, hits

    def _fits(self, tokens: list[int], hits: list[int], n_want: int) -> int:
        """How many of ``n_want`` samples the free blocks admit now (0: none)."""
        bs, pool = self.pool.block_size, self.pool
        first = -(-len(tokens) // bs) - len(hits) + sum(pool.ref_count[b] == 0 for b in hits)
        per_extra = 1 if len(tokens) % bs else 0
        headroom = 1 if self.running else 0
        for take in range(n_want, 0, -1):
            if first + (take - 1) * per_extra + headroom * take <= pool.num_free:
                return take
        return 0

    def _allocate(
        self, tokens: list[int], hashes: list[int], hits: list[int], want_routed: bool
    ) -> list[int]:
        """The block table of ``tokens``: the hits shared, fresh blocks for the rest; fresh full blocks
        are indexed now (a later admission in this step may hit them: the prefill computes them first,
        with routed experts when ``want_routed``)."""
        bs, pool = self.pool.block_size, self.pool
        for b in hits:
            pool.share(b)
        blocks = list(hits)
        for i in range(len(hits), -(-len(tokens) // bs)):
            blocks.append(pool.allocate())
            pool.has_routed[blocks[-1]] = want_routed
            if i < len(hashes):
                parent = hashes[i - 1] if i else 0
                pool.index(blocks[i], hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
        return blocks

    # -- Decode growth and preemption -----------------------------------------------------------

    def blocks_short(self) -> int:
        """Blocks the next decode step needs beyond the free ones (<= 0: none missing)."""
        return sum(self._needs_block(s) for s in self.running) - self.pool.num_free

    def _needs_block(self, seq: Sequence) -> bool:
        # the next decode writes position seq_len - 1
        return seq.seq_len > len(seq.blocks) * self.pool.block_size

    def preempt(self, short: int, before_release=None) -> list[Sequence]:
        """Preempt the youngest running sequences until ``short`` blocks are found (the oldest is
        never preempted); their blocks are released and they wait for readmission, oldest first.

        Args:
            short: blocks missing (``blocks_short``).
            before_release: called with each victim before its blocks are released (to save its
                routed-experts records).
        Returns:
            The preempted sequences (still in their rows: the caller removes them, ``remove``).
        """
        victims: list[Sequence] = []
        candidates = sorted(self.running, key=lambda s: s.arrival)
        while short > 0 and len(candidates) > 1:
            seq = candidates.pop()
            short -= self._needs_block(seq)
            if before_release is not None:
                before_release(seq)
            for b in seq.blocks:
                self.pool.release(b)
                short -= self.pool.ref_count[b] == 0
            seq.blocks = []
            victims.append(seq)
        self.num_preemptions += len(victims)
        self.preempted = sorted(self.preempted + victims, key=lambda s: s.arrival)
        return victims

    def grow(self) -> list[Sequence]:
        """Give every running sequence whose next token starts a block a fresh one.

        Returns:
            The sequences that got a block (its id is their ``blocks[-1]``).
        """
        grown = [s for s in self.running if self._needs_block(s)]
        for seq in grown:
            seq.blocks.append(self.pool.allocate())
        return grown

    def drop_all(self) -> list[Sequence]:
        """Forget waiting and preempted requests (running ones are left to the caller); returns the
        preempted sequences dropped."""
        dropped = self.preempted
        for seq in dropped:
            self._in_flight.pop(seq.request.request_id, None)
        for w in self._waiting:
            self._in_flight.pop(w.request.request_id, None)
        self.preempted = []
        self._waiting.clear()
        return dropped
