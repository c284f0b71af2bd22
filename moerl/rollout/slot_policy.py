"""The slot cache policy: one contiguous, preallocated region per sequence row (``rollout.kv_cache: slots``).

Shapes: N slots, S tokens per slot, R prefill rows, T padded prompt length, B decode rows, Lm MoE
layers, K top-k.

A request whose prompt + ``max_new_tokens`` exceeds S can never run (rejected at ``add_request``);
otherwise it waits until a slot is free (``scheduler.Scheduler``: FIFO, a group's samples together when
they fit). A group's prompt is prefilled once into its first sample's slot and copied into the others'.
When sequences finish the last running ones are moved (their keys copied) into the freed slots, so a
decode batch is always a prefix of the slots and reads ``k[l, :B, :, :R]``: a fixed-shape strided
view per (B, R) key, what CUDA graphs need. No preemption: a slot holds its whole sequence.
"""

from __future__ import annotations

import torch

from moerl.rollout.cache_policy import CacheSpec, PrefillRow, RoundLen, right_padded
from moerl.rollout.kv_cache import SlotKVCache, cache_geometry
from moerl.rollout.scheduler import Admission, Scheduler, Sequence


class SlotCachePolicy:
    """``CachePolicy`` over ``SlotKVCache`` (module docstring).

    Args:
        spec: N = ``min(max_slots, kv_token_budget // S)`` slots of S = ``max_seq_len`` tokens (None:
            ``kv_token_budget // max_slots``), capped at the model's context (``kv_cache.cache_geometry``).

    Raises:
        ValueError: sizes that leave no slot of at least 2 tokens; ``block_size`` given (slots do not page).
    """

    kind = "slots"

    def __init__(self, spec: CacheSpec) -> None:
        if spec.block_size is not None:
            raise ValueError(f"block_size={spec.block_size} applies to the paged cache, not to slots")
        num_slots, slot_len = cache_geometry(
            spec.max_slots, spec.kv_token_budget, spec.context, spec.max_seq_len
        )
        if slot_len < 2 or num_slots < 1:
            raise ValueError(
                f"max_slots={spec.max_slots}, kv_token_budget={spec.kv_token_budget}, "
                f"max_seq_len={spec.max_seq_len} leave no cache slot of at least 2 tokens (model context "
                f"{spec.context})"
            )
        self.kv = SlotKVCache(
            spec.layout, num_slots=num_slots, capacity=slot_len, dtype=spec.dtype, device=spec.device
        )
        self.scheduler = Scheduler(num_slots, spec.max_prefill_tokens)
        self.num_slots = num_slots
        self.max_seq_len = slot_len
        self.row_state: list[torch.Tensor] = []
        self._device = spec.device
        self._routed_at: tuple[torch.Tensor, int] | None = None  # (slots [R], T) of a bound prefill
        self._decode_at: tuple[int, torch.Tensor] | None = None  # (B, positions [B]) of a bound decode

    # -- Prefill ------------------------------------------------------------------------------------

    def bind_prefill(self, rows: list[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows start at position 0 (no prefix hits); row r's keys go to its sequence's slot."""
        dev = self._device
        ids = right_padded([r.tokens for r in rows])
        t = ids.shape[1]
        lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64, device=dev)
        slots = torch.tensor([r.seq.slot for r in rows], dtype=torch.int64, device=dev)
        self.kv.bind_prefill(slots, lengths, t)
        self._routed_at = (slots, t)
        return ids, torch.arange(t, device=dev).expand(len(rows), t)

    def record_routed(self, routed: torch.Tensor) -> None:
        buf = self.kv.ensure_routed(routed.shape[2], routed.shape[3])
        if self._routed_at is not None:  # a prefill: [R, T, Lm, K] into the rows' slots
            slots, t = self._routed_at
            buf[slots, :t] = routed.to(torch.int32)
        else:  # a decode: [B, 1, Lm, K] at each row's position
            b, pos = self._decode_at
            buf[torch.arange(b, device=self._device), pos] = routed[:, 0].to(torch.int32)

    def unbind(self) -> None:
        self.kv.unbind()
        self._routed_at = self._decode_at = None

    def place_prefill(self, admissions: list[Admission]) -> None:
        """Copy each group's prompt keys (and routed experts) from its first slot into the others'."""
        for a in admissions:
            slots = [s.slot for s in a.sequences]
            self.kv.copy_slots([slots[0]] * (len(slots) - 1), slots[1:], len(a.request.prompt_ids))

    # -- Decode -------------------------------------------------------------------------------------

    def blocks_short(self) -> int:
        """Never short: a slot holds its whole sequence."""
        return 0

    def preempt(self, short: int) -> list[Sequence]:
        """Nothing to evict (``blocks_short`` is never positive)."""
        return []

    def prepare_decode(self, batch_rows: int) -> None:
        """Nothing to prepare: the slot already has room."""

    def read_len(self, seqs: list[Sequence], multiple: int, round_len: RoundLen) -> int:
        """R, keys per row: the longest sequence rounded up by ``round_len`` to ``multiple``, capped at S."""
        return round_len(max(s.seq_len for s in seqs), multiple, self.max_seq_len)

    def decode_variant(self) -> tuple:
        return ()

    def bind_decode(self, num_rows: int, positions: torch.Tensor, read_len: int) -> None:
        self.kv.bind_decode(num_rows, positions, read_len)
        self._decode_at = (num_rows, positions)

    # -- Finishing ----------------------------------------------------------------------------------

    def routed_records(self, seq: Sequence, length: int) -> torch.Tensor:
        return self.kv.routed[seq.slot, :length]

    def release(self, seqs: list[Sequence]) -> None:
        """Nothing held beyond the slot, which the scheduler frees."""

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy the movers' keys: up to the longest mover's length (positions past a slot's length are
        never read)."""
        running = self.scheduler.running
        self.kv.copy_slots(src, dst, max(running[d].seq_len for d in dst))

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Nothing per row beyond the engine's state."""

    def weights_changed(self) -> None:
        """Slots index nothing by content: running sequences keep their keys."""

    def capacity(self) -> tuple[int, int, int]:
        """Slot tokens in all, slots, and slots in use."""
        running = len(self.scheduler.running)
        return self.kv.num_slots * self.kv.capacity, self.num_slots, running
