"""Engine statistics: what the KV cache holds and how much work the scheduler did (``Engine.stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one engine's cache and counters (cumulative counters since the engine started).

    For the slot engine a "block" is a whole slot; for the paged engine a block of ``block_size`` tokens.
    """

    kv_tokens: int
    """Token capacity of the cache (slots x slot length, or blocks x block size)."""
    kv_tokens_used: int
    """Tokens held by running sequences (a shared block counted once per sequence)."""
    blocks_total: int
    """Blocks (slots) of the cache."""
    blocks_used: int
    """Blocks (slots) referenced by running sequences."""
    running: int
    """Sequences decoding together now."""
    prefill_tokens: int
    """Tokens computed by prefill forwards (prompts and, paged, readmissions of preempted sequences)."""
    decode_steps: int
    """Decode forwards run."""
    decode_rows: int
    """Sum over decode forwards of the sequences they decoded (/ ``decode_steps``: the mean batch)."""
    prefix_hit_tokens: int = 0
    """Prefix tokens taken from the cache instead of computed: a group's shared prompt (n - 1 times its
    length) and full blocks found in the hash index (paged only)."""
    preemptions: int = 0
    """Sequences preempted for lack of free blocks (paged only)."""
    spec_steps: int = 0
    """Speculative decode steps (``rollout.speculative``; ``moerl.rollout.speculative``)."""
    spec_drafted: int = 0
    """Tokens drafted in them (cumulative)."""
    spec_accepted: int = 0
    """Drafted tokens accepted (cumulative)."""
    spec_acceptance_recent: float | None = None
    """Accepted / drafted over the engine's last ``SpecPolicy.window`` speculative steps (None: none yet)."""
    spec_accepted_per_step_recent: float | None = None
    """Accepted drafts per sequence and speculative step over the same window (None: none yet)."""
    spec_draft_s: float = 0.0
    """Seconds spent drafting on the host (cumulative; the MTP drafter drafts inside the verify step)."""
    spec_off_batch: int = 0
    """Steps decoded plainly because more than ``SpecPolicy.max_batch`` sequences ran (cumulative)."""
    spec_off_acceptance: int = 0
    """Steps decoded plainly because the recent acceptance rate was too low (cumulative)."""
    spec_off_cost: int = 0
    """Steps decoded plainly because speculation was measured slower than plain decoding (cumulative)."""
    spec_step_ms: float | None = None
    """Mean host milliseconds per speculative step, start to its host sync (None: none measured)."""
    plain_step_ms: float | None = None
    """Mean host milliseconds per plain decode step of a speculating engine, over runs of plain steps
    between two host syncs (None: none measured)."""

    @property
    def blocks_free(self) -> int:
        """Blocks (slots) not referenced by a running sequence."""
        return self.blocks_total - self.blocks_used

    @property
    def mean_decode_batch(self) -> float:
        """Mean sequences decoding together per decode step (0 before the first)."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0
