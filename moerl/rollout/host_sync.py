"""The engine's host sync: tokens sampled on the device that the host has not read yet, and their copy.

The decode loop never waits for the device between syncs (``moerl.rollout.engine``): each decode (or
prefill) step appends its sampled tokens and log-probs, still on the device, as one pending entry
(``record``). Every ``sync_every`` steps, or when a sequence reaches its length limit, the pending entries
are copied to the host in one transfer and appended to their sequences, which finish at their first stop
token or at ``max_new_tokens`` (``read_all``). With the overlapped sync (on by default on CUDA) the copy
is started without waiting (``stage``) and read a step later (``read_staged``), after the next decode
was enqueued: the device decodes while the host finishes sequences.

A speculative step records one entry of several tokens per row (``record_several``: [M, J] tokens, of
which row m emitted ``emitted[m]``, a device count); its rows' counts travel in the same copy. Until the
host reads them, each sequence carries the most tokens its unread speculative entries may have added
(``Sequence.unread``), so the engine can plan further speculative steps from upper bounds (blocks, read
length, length limit) without waiting for the device.

Shapes: M = rows of one pending entry (its running sequences), J = tokens per row of a speculative entry
(K + 1), P = float64 values of all pending entries (2 per row of a one-token entry, 1 + 2J per row of a
several-token entry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moerl.rollout.scheduler import Sequence


@dataclass(slots=True)
class _Staged:
    """A host copy of the first ``count`` pending entries' tokens, started without waiting (``stage``)."""

    count: int
    values: torch.Tensor  # [P] float64 on the host (pinned on CUDA): the entries' packed values
    copied: torch.cuda.Event | None  # recorded after the copy on CUDA


@dataclass(slots=True)
class _Pending:
    """Tokens sampled on the device and not yet copied to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [M] int64, or [M, J] with ``emitted``
    logprobs: torch.Tensor  # [M] float32, or [M, J] with ``emitted``
    version: int
    emitted: torch.Tensor | None = None  # [M] int64 tokens row m emitted (a speculative step), else None
    emitted_read: list[int] | None = None  # ``emitted`` once the host read it (``take``)
    bounds: list[int] | None = None  # the most tokens row m may emit (k_m + 1), with ``emitted``

    def packed(self) -> torch.Tensor:
        """This entry's values, float64 on the device, row by row: (token, log-prob) per row, or
        (emitted, J tokens, J log-probs) per row of a several-token entry."""
        if self.emitted is None:
            return torch.stack((self.tokens.double(), self.logprobs.double()), 1).reshape(-1)
        cols = (self.emitted.double()[:, None], self.tokens.double(), self.logprobs.double())
        return torch.cat(cols, 1).reshape(-1)


class HostSync:
    """Pending device tokens of one engine and their copy to the host.

    Args:
        sync_every: steps (prefill or decode) between host copies (>= 1).
        overlap: start a due copy without waiting and read it a step later (``stage``/``read_staged``).
    """

    def __init__(self, sync_every: int, overlap: bool) -> None:
        self.sync_every = sync_every
        self.overlap = overlap
        self.pending: list[_Pending] = []
        self.staged: _Staged | None = None  # a started copy of the first pending entries (``stage``)
        self.steps = 0
        """Steps recorded since the last copy (what ``due`` compares with ``sync_every``)."""
        self.on_read: Callable[[], None] | None = None
        """Called each time the host has read copied tokens (after waiting for them): the engine's
        speculation measures its cost at these existing syncs."""
        self.on_several: Callable[[_Pending], None] | None = None
        """Called with each several-token entry once its counts are read (``emitted_read`` set): the
        engine's speculation counts its accepted drafts there."""

    def __bool__(self) -> bool:
        """Whether any token is pending (sampled and not yet read by the host)."""
        return bool(self.pending)

    def record(
        self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, version: int
    ) -> None:
        """One step's sampled tokens ([M] int64) and log-probs ([M] float32) of ``seqs``, on the device,
        sampled with weights ``version``. Counts each sequence's generated token at once (the host reads
        the value later)."""
        for s in seqs:
            s.num_generated += 1
        self.pending.append(_Pending(list(seqs), tokens, logprobs, version))

    def record_several(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        emitted: torch.Tensor,
        version: int,
        bounds: list[int],
    ) -> _Pending:
        """One speculative step's tokens ([M, J] int64, on the device) and log-probs ([M, J] float32) of
        ``seqs``, of which row m emitted the first ``emitted[m]`` ([M] int64, on the device), at most
        ``bounds[m]`` (host ints: its drafts + 1). The rows' ``num_generated`` grows when the host reads
        the counts (``take``); until then each row's ``Sequence.unread`` holds its bound. Returns the
        entry; its ``emitted_read`` holds the host counts once read."""
        entry = _Pending(list(seqs), tokens, logprobs, version, emitted, bounds=list(bounds))
        for s, n in zip(entry.seqs, entry.bounds, strict=True):
            s.unread += n
        self.pending.append(entry)
        return entry

    @property
    def has_several(self) -> bool:
        """Whether a speculative entry is pending: some sequence's device length is not known exactly."""
        return any(p.emitted is not None for p in self.pending)

    def due(self, at_limit: Callable[[], bool]) -> bool:
        """Whether a copy is due: tokens pending and ``sync_every`` steps since the last, or ``at_limit()``
        (a running sequence has all its tokens: it must not decode again; asked only when needed)."""
        return bool(self.pending) and (self.steps >= self.sync_every or at_limit())

    def read_all(self) -> list[Sequence]:
        """Copy every pending token to the host (waiting for the device) and append them (``take``); a
        started copy is dropped (this one covers it). Returns the sequences that finished."""
        self.staged = None
        return self.take(len(self.pending), self._packed().tolist())

    def stage(self) -> None:
        """Start the host copy of the pending tokens without waiting for it (read by ``read_staged``)."""
        packed = self._packed()
        copied = None
        if packed.is_cuda:
            values = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            values.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            values = packed
        self.staged = _Staged(len(self.pending), values, copied)

    def read_staged(self) -> list[Sequence]:
        """Wait for the started copy (not for work enqueued since) and append its tokens (``take``).
        Returns the sequences that finished."""
        staged, self.staged = self.staged, None
        if staged.copied is not None:
            staged.copied.synchronize()
        return self.take(staged.count, staged.values.tolist())

    def read_everything(self) -> list[Sequence]:
        """A started copy, then every token still pending: afterwards the host knows every token."""
        done = self.read_staged() if self.staged is not None else []
        return done + (self.read_all() if self.pending else [])

    def take(self, count: int, values: list[float]) -> list[Sequence]:
        """Append the host ``values`` (``_Pending.packed``, concatenated) of the first ``count`` pending entries to
        their sequences, with each entry's version; a sequence finishes at a stop token (``"stop"``) or its
        length limit (``"length"``). Entries left (recorded after a started copy) stay pending unless all
        their rows finished. Returns the sequences that finished."""
        if self.on_read is not None:
            self.on_read()
        flat = iter(values)
        finished: list[Sequence] = []
        for p in self.pending[:count]:
            if p.emitted is not None:
                p.emitted_read = []
            for m, seq in enumerate(p.seqs):
                if p.emitted is None:
                    toks, lps = [next(flat)], [next(flat)]
                else:
                    n, width = int(next(flat)), p.tokens.shape[1]
                    row = [next(flat) for _ in range(2 * width)]
                    toks, lps = row[:n], row[width : width + n]
                    p.emitted_read.append(n)
                    seq.num_generated += n  # a one-token entry counted its token at ``record``
                    seq.unread -= p.bounds[m]
                for tok_f, lp in zip(toks, lps, strict=True):
                    if _append(seq, int(tok_f), lp, p.version):
                        finished.append(seq)
            if p.emitted is not None and self.on_several is not None:
                self.on_several(p)
        del self.pending[:count]
        if finished and self.pending:  # tokens decoded after a row's last one carry nothing
            self.pending = [p for p in self.pending if any(s.finish_reason is None for s in p.seqs)]
        self.steps = len(self.pending)
        return finished

    def clear(self) -> None:
        """Forget every pending token and a started copy (the engine dropped its running sequences)."""
        for p in self.pending:
            for s in p.seqs:
                s.unread = 0
        self.pending.clear()
        self.staged = None
        self.steps = 0

    def _packed(self) -> torch.Tensor:
        """[P] float64 on the device: the pending entries' values (``_Pending.packed``; token ids and
        counts are exact in float64), in entry then row order."""
        return torch.cat([p.packed() for p in self.pending])


def _append(seq: Sequence, tok: int, logprob: float, version: int) -> bool:
    """Append one read token to ``seq`` unless it already finished (a token sampled after its stop token
    before the host noticed is discarded); returns whether ``seq`` finished with it (a stop token:
    ``"stop"``; its ``max_new_tokens``: ``"length"``)."""
    if seq.finish_reason is not None:
        return False
    seq.token_ids.append(tok)
    seq.logprobs.append(logprob)
    seq.policy_versions.append(version)
    params = seq.request.params
    if tok in params.stop_token_ids:
        seq.finish_reason = "stop"
    elif len(seq.token_ids) >= params.max_new_tokens:
        seq.finish_reason = "length"
    return seq.finish_reason is not None
