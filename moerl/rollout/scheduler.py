"""Continuous-batching scheduler: host-side bookkeeping of waiting requests and running slots.

No tensors here: the engine owns the device state and applies the slot moves this scheduler plans.

- A request waits in a FIFO queue until slots are free; its n samples are admitted together when enough
  slots are free, else as many as fit (the rest stay at the head of the queue and are admitted, with
  another prefill of the prompt, as slots free). The first request of the queue is never skipped.
- Running sequences always occupy slots 0..A-1: when sequences finish, the last running ones move into
  the holes (``release`` returns the moves), so a decode batch is a prefix of the slots.
- A step's prefills are capped at ``max_prefill_tokens`` prompt tokens (at least one request is admitted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moerl.rollout.params import Request


@dataclass(kw_only=True, slots=True)
class Sequence:
    """One running sample: a request's sample in a cache slot."""

    request: Request
    sample_index: int
    slot: int
    """Cache slot; changes when the scheduler compacts the running slots."""
    noise_key: int
    """32-bit noise key of this sample (``sampler.sample_key(seed, sample_index)``)."""
    num_generated: int = 0
    """Tokens generated so far, counted on the host (including ones not yet copied back)."""
    unread: int = 0
    """Tokens that speculative steps not yet read by the host may have added, at most (their k_b + 1
    each; ``HostSync.record_several``): the device's length lies in [seq_len, seq_len + unread]."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = 0
    """Admission order of the sample (lower = older); the paged scheduler preempts the youngest."""
    blocks: list[int] = field(default_factory=list)
    """Block table of the paged cache (``paged_scheduler``); empty in the slot engine."""
    saved_routed: object = None
    """Routed-experts records kept on the host while the sequence is preempted (paged engine, R3)."""

    @property
    def prompt_len(self) -> int:
        """P, prompt tokens."""
        return len(self.request.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Prompt plus generated tokens (host count)."""
        return self.prompt_len + self.num_generated

    @property
    def max_len(self) -> int:
        """Prompt plus ``max_new_tokens``: the length the sequence never passes."""
        return self.prompt_len + self.request.params.max_new_tokens


@dataclass(kw_only=True, slots=True)
class Admission:
    """Samples of one request admitted in this step; they share one prefill of ``tokens[cached:]``."""

    request: Request
    sequences: list[Sequence]
    """The admitted samples; ``sequences[0]``'s cache receives the prefill, the others the prompt's keys
    from it (the cache policy's ``place_prefill``: a copy, or shared blocks)."""
    tokens: list[int]
    """The prefix held in the cache: the prompt (a new request) or prompt + generated tokens but the
    last (a preempted sequence readmitted)."""
    cached: int = 0
    """Leading tokens found in the cache (prefix hits): not recomputed."""
    resumed: bool = False
    """A preempted sequence readmitted: no token is sampled after the prefill."""


@dataclass(slots=True)
class _Waiting:
    request: Request
    seed: int
    next_sample: int = 0


class Scheduler:
    """FIFO admission into a fixed number of slots with slot compaction.

    Args:
        num_slots: N sequence slots.
        max_prefill_tokens: prompt tokens admitted per step (at least one request is always admitted).
    """

    def __init__(self, num_slots: int, max_prefill_tokens: int) -> None:
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.running: list[Sequence] = []
        """Running sequences; ``running[i].slot == i``."""
        self._waiting: deque[_Waiting] = deque()
        self._in_flight: dict[str, int] = {}  # request id -> samples not yet finished
        self.prefill_tokens = 0
        """Tokens computed by prefills since the scheduler started (planned at admission)."""
        self.prefix_hit_tokens = 0
        """Prefix tokens taken from the cache instead of computed (a group's n - 1 shared prompts)."""
        self.num_preemptions = 0
        """Sequences preempted since the scheduler started (none here: a slot holds its sequence)."""

    @property
    def num_unfinished(self) -> int:
        """Samples waiting or running."""
        return sum(self._in_flight.values())

    def is_in_flight(self, request_id: str) -> bool:
        """True while some sample of the request is waiting or running."""
        return request_id in self._in_flight

    def running_by_request(self) -> dict[str, list[Sequence]]:
        """The running sequences of each request id; a copy, safe to call from another thread."""
        out: dict[str, list[Sequence]] = {}
        for seq in list(self.running):
            out.setdefault(seq.request.request_id, []).append(seq)
        return out

    def add(self, request: Request, seed: int) -> None:
        """Queue a (validated) request whose noise seed is ``seed``."""
        self._waiting.append(_Waiting(request, seed))
        self._in_flight[request.request_id] = request.params.n

    def admit(self, noise_key) -> list[Admission]:
        """Move waiting samples into free slots, FIFO; returns this step's admissions.

        Args:
            noise_key: ``(seed, sample_index) -> int``, the noise key of a sample.
        """
        admissions: list[Admission] = []
        prefill_tokens = 0
        while self._waiting and len(self.running) < self.num_slots:
            head = self._waiting[0]
            plen = len(head.request.prompt_ids)
            if admissions and prefill_tokens + plen > self.max_prefill_tokens:
                break
            take = min(head.request.params.n - head.next_sample, self.num_slots - len(self.running))
            seqs = []
            for i in range(head.next_sample, head.next_sample + take):
                seq = Sequence(
                    request=head.request,
                    sample_index=i,
                    slot=len(self.running),
                    noise_key=noise_key(head.seed, i),
                )
                self.running.append(seq)
                seqs.append(seq)
            admissions.append(
                Admission(request=head.request, sequences=seqs, tokens=list(head.request.prompt_ids))
            )
            prefill_tokens += plen
            self.prefill_tokens += plen
            self.prefix_hit_tokens += (take - 1) * plen
            head.next_sample += take
            if head.next_sample == head.request.params.n:
                self._waiting.popleft()
        return admissions

    def release(self, finished: list[Sequence]) -> list[tuple[int, int]]:
        """Free the slots of finished sequences and compact the running ones into slots 0..A-1.

        Returns:
            ``(src, dst)`` slot moves the engine must apply to its device state, in order.
        """
        if not finished:
            return []
        for seq in finished:
            self._in_flight[seq.request.request_id] -= 1
            if self._in_flight[seq.request.request_id] == 0:
                del self._in_flight[seq.request.request_id]
        return self.remove(finished)

    def remove(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Take ``seqs`` out of the running slots (finished, or preempted: still in flight) and compact
        the others into slots 0..A-1; returns the ``(src, dst)`` slot moves, in order."""
        if not seqs:
            return []
        finished = seqs
        done = {id(s) for s in finished}
        keep = [s for s in self.running if id(s) not in done]
        new_count = len(keep)
        holes = [s.slot for s in finished if s.slot < new_count]
        movers = [s for s in keep if s.slot >= new_count]
        moves = []
        for hole, seq in zip(sorted(holes), movers, strict=True):
            moves.append((seq.slot, hole))
            seq.slot = hole
        self.running = sorted(keep, key=lambda s: s.slot)
        return moves

    def drop_all(self) -> list[Sequence]:
        """Forget waiting requests (running ones are left to the caller); returns the sequences dropped
        that had started (none here)."""
        for w in self._waiting:
            self._in_flight.pop(w.request.request_id, None)
        self._waiting.clear()
        return []
