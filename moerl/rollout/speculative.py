"""Speculative decoding: drafters, the exact acceptance rule, and when speculation pays.

Shapes: B rows (sequences), K drafted tokens per row at most (``rollout.speculative_tokens``), V
vocabulary, H hidden size.

One speculative step of a sequence whose last sampled token t is not yet fed: a drafter proposes
d_0..d_{k-1} (k <= K) with draft distributions q_j; the policy runs one forward over [t, d_0, ...,
d_{k-1}] and gives the target distributions p_0..p_k (temperature, top-k, top-p applied exactly as the
sampler does: ``policy_probs``). ``verify_drafts`` then walks j = 0, 1, ...: d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token is drawn from
norm(max(0, p_j - q_j)) and the step ends; when all k are accepted a bonus token is drawn from p_k.
Leviathan, Kalman & Matias 2023 ("Fast Inference from Transformers via Speculative Decoding", Algorithm
1, Theorem 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling", Algorithm 2,
Theorem 1) prove that each emitted token is then distributed exactly as p_j: the rollout samples the
policy's distribution, whatever the drafter. A deterministic drafter (n-gram) has q_j = one-hot(d_j):
accept with probability p_j(d_j), else draw from p_j without d_j. A greedy row (T = 0) has p_j =
one-hot(argmax): a draft is kept iff it is the argmax, so greedy output is identical with and
without speculation.

The log-prob recorded for every emitted token is the policy's, ``token_logprobs`` of the verify
forward's logits (untruncated, at the row's temperature, greedy at 1): the convention of the sampler.

Randomness is counter-based like the sampler's (``moerl.rollout.sampler``): the accept test, the
residual draw and the drafter's own draw at sequence position i use uniforms keyed by (sample key,
purpose, i); a bonus token uses exactly the sampler's uniform of position i, so a step with no draft
equals a plain decode step.

Drafters (``DRAFTERS``, ``rollout.speculative``): ``ngram`` (prompt lookup: the tokens that followed the
latest earlier occurrence of the context's last n-gram; Saxena 2023, "Prompt Lookup Decoding") and
``mtp`` (the policy's multi-token-prediction module, ``moerl.models.mtp``, chained k times on its own
hidden state). ``SpecPolicy`` decides per engine step whether to speculate at all (batch size and the
recent acceptance rate).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moerl.rollout.sampler import SamplingRows, hash_combine, sample_no_sync, truncation_mask, uniform_no_sync

SPECULATIVE = ("off", "mtp", "ngram")
"""``rollout.speculative`` choices: no speculation, the MTP drafter, the n-gram (prompt lookup) drafter."""

_ACCEPT, _RESIDUAL, _DRAFT = 0xACCE, 0x2E51, 0xD2AF  # purposes of the counter-based uniforms


def purpose_keys(keys: torch.Tensor, purpose: int) -> torch.Tensor:
    """[B] int64 noise keys for one purpose (accept test, residual draw, draft draw), derived from the
    rows' sample keys so that no two purposes share a uniform."""
    return hash_combine(keys, purpose)


def policy_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The distribution the sampler draws from, per row and position: softmax(logits / T) restricted to
    the top-k / top-p set and renormalized (``sampler.truncation_mask``); a greedy row (T = 0) gives
    one-hot(argmax, first index on ties).

    Args:
        logits: [B, J, V] any float dtype.
        rows: the rows' sampling parameters ([B] tensors).
    Returns:
        [B, J, V] float64 probabilities (each row sums to 1).
    """
    b, j, v = logits.shape
    greedy = rows.temperature == 0.0
    temp = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    scaled = (logits.float() / temp[:, None, None]).reshape(b * j, v)
    if rows.any_truncation and not rows.all_greedy:
        keep = truncation_mask(scaled, rows.top_k.repeat_interleave(j), rows.top_p.repeat_interleave(j))
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = scaled.double().softmax(-1).view(b, j, v)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None, None], onehot, probs)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: [B, V] probabilities (need not sum to 1), [B] uniforms in
    [0, 1) -> [B] int64 (the first token whose cumulative mass exceeds u times the total)."""
    cdf = probs.double().cumsum(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return drawn.clamp_(max=probs.shape[-1] - 1)


@dataclass(frozen=True, slots=True)
class Verified:
    """What one speculative step emits per row."""

    tokens: torch.Tensor
    """[B, K + 1] int64: the accepted drafts, then the corrected or bonus token (valid up to ``num_emitted``)."""
    logprobs: torch.Tensor
    """[B, K + 1] float32 policy log-probs of ``tokens`` (``sampler.token_logprobs`` convention)."""
    num_accepted: torch.Tensor
    """[B] int64 drafts accepted, a in [0, k_b]; the row emits a + 1 tokens."""


def verify_drafts(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    rows: SamplingRows,
    first_position: torch.Tensor,
) -> Verified:
    """Accept or reject each row's drafts by the rejection-sampling rule (module docstring; Leviathan et
    al. 2023 Algorithm 1, Chen et al. 2023 Algorithm 2), so each emitted token has the policy's
    distribution.

    Args:
        target_logits: [B, K + 1, V] the policy's logits at the positions of [t, d_0, ..., d_{K-1}]:
            position j predicts the token after d_{j-1}.
        drafts: [B, K] int64 drafted tokens (entries past ``num_drafts`` are ignored).
        draft_probs: [B, K, V] the draft distributions q_j the drafts were drawn from; None: the drafts
            are deterministic (q_j = one-hot(d_j)).
        num_drafts: [B] int64 k_b <= K drafts of each row.
        rows: the rows' sampling parameters.
        first_position: [B] int64 sequence position of the first emitted token (the noise counter).
    Returns:
        ``Verified``.
    """
    b, k1, _ = target_logits.shape
    dev = target_logits.device
    p = policy_probs(target_logits, rows)
    greedy = rows.temperature == 0.0
    temp = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature).float()
    scaled = target_logits.float() / temp[:, None, None]
    tokens = torch.zeros(b, k1, dtype=torch.int64, device=dev)
    accepted = torch.zeros(b, dtype=torch.int64, device=dev)
    running = torch.ones(b, dtype=torch.bool, device=dev)
    k_acc, k_res = purpose_keys(rows.keys, _ACCEPT), purpose_keys(rows.keys, _RESIDUAL)
    for j in range(k1):
        pos = first_position + j
        has_draft = running & (num_drafts > j)
        bonus = running & (num_drafts == j)
        if bool(bonus.any()):  # the sampler's own draw at this position: a plain decode step
            tok, _ = sample_no_sync(target_logits[:, j], rows, pos)
            tokens[:, j] = torch.where(bonus, tok, tokens[:, j])
        if j == k1 - 1 or not bool(has_draft.any()):
            running &= ~bonus
            break
        d = drafts[:, j]
        pj = p[:, j]
        if draft_probs is None:
            q = torch.zeros_like(pj).scatter_(-1, d[:, None], 1.0)
        else:
            q = draft_probs[:, j].double()
        ratio = pj.gather(-1, d[:, None]).squeeze(-1) / q.gather(-1, d[:, None]).squeeze(-1).clamp(min=1e-300)
        ok = uniform_no_sync(k_acc, pos) < ratio
        residual = (pj - q).clamp(min=0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pj)  # p == q up to rounding
        fixed = draw(residual, uniform_no_sync(k_res, pos))
        take = has_draft & ok
        tokens[:, j] = torch.where(take, d, torch.where(has_draft, fixed, tokens[:, j]))
        accepted += take.long()
        running &= ~bonus & ~(has_draft & ~ok)
    logp = scaled.gather(-1, tokens[..., None]).squeeze(-1) - scaled.logsumexp(-1)
    return Verified(tokens=tokens, logprobs=logp, num_accepted=accepted)


# -- Drafters -----------------------------------------------------------------------------------


@dataclass(slots=True)
class DraftRequest:
    """One row's context for a drafter."""

    context: list[int]
    """All tokens so far (prompt + generated); the last one is the token fed next (not yet in the cache)."""
    max_drafts: int
    """k_b: drafts wanted at most (0: none)."""
    key: int
    """The row's noise key (``sampler.sample_key``)."""
    seq_id: int
    """Identity of the sequence (drafter state such as the MTP's hidden history is kept by it)."""


@dataclass(frozen=True, slots=True)
class Drafts:
    """A drafter's proposals for B rows."""

    tokens: torch.Tensor
    """[B, K] int64 (zeros past ``num_drafts``)."""
    num_drafts: torch.Tensor
    """[B] int64 k_b."""
    probs: torch.Tensor | None = None
    """[B, K, V] the draft distributions; None = deterministic drafts (one-hot q)."""


class Drafter(Protocol):
    """Proposes tokens for a batch of rows; ``observe`` gets the policy's hidden states of the positions
    the verify forward fed and kept (for drafters that condition on them)."""

    def propose(self, requests: Seq[DraftRequest], rows: SamplingRows, k: int) -> Drafts:
        """At most ``k`` drafts per row (each row's ``max_drafts`` caps it)."""
        ...

    def observe(self, seq_id: int, first_position: int, hidden: torch.Tensor) -> None:
        """The policy's final hidden states [n, H] of positions ``first_position .. + n - 1``."""
        ...

    def forget(self, live: set[int]) -> None:
        """Drop the state of every sequence not in ``live``."""
        ...


@dataclass(slots=True)
class NgramDrafter:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the context's last n
    tokens (n from ``max_n`` down to ``min_n``) and propose the tokens that followed it. Model-free,
    deterministic (one-hot q)."""

    max_n: int = 3
    min_n: int = 1

    def propose(self, requests: Seq[DraftRequest], rows: SamplingRows, k: int) -> Drafts:
        """See ``Drafter.propose``; a row without a match gets 0 drafts."""
        out = torch.zeros(len(requests), max(k, 1), dtype=torch.int64)
        counts = torch.zeros(len(requests), dtype=torch.int64)
        for r, req in enumerate(requests):
            found = self.lookup(req.context, min(k, req.max_drafts))
            out[r, : len(found)] = torch.tensor(found, dtype=torch.int64)
            counts[r] = len(found)
        dev = rows.keys.device
        return Drafts(tokens=out.to(dev), num_drafts=counts.to(dev))

    def lookup(self, context: list[int], k: int) -> list[int]:
        """The up to ``k`` tokens after the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []

    def observe(self, seq_id: int, first_position: int, hidden: torch.Tensor) -> None:
        """Not used: the n-gram drafter needs no hidden states."""

    def forget(self, live: set[int]) -> None:
        """Nothing kept."""


@dataclass(slots=True)
class MtpDrafter:
    """Drafts from the policy's MTP module (``moerl.models.mtp``): d_0 from (Emb(t), h) of the last fed
    position, then d_j from (Emb(d_{j-1}), h^mtp_{j-1}) (the layer chained on its own output, as vLLM does
    for k > depth). The MTP block attends over the last ``window`` positions (recomputed each draft, no
    cache of its own), so a sequence keeps the policy's last ``window`` hidden states (``observe``);
    a sequence with no hidden state of its last fed position yet (its first step after a prefill or a
    pause in speculation) gets 0 drafts. Drafts are sampled from q = ``policy_probs`` of the MTP logits
    (greedy rows: its argmax).

    Raises:
        ValueError: the model has no MTP layer.
    """

    model: torch.nn.Module
    window: int = 32
    history: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """seq_id -> (position of the first kept hidden state, [n, H] hidden states)."""

    def __post_init__(self) -> None:
        if not len(getattr(self.model, "mtp_layers", ())):
            raise ValueError("rollout.speculative=mtp needs a policy with an MTP layer (moerl.models.mtp)")

    def observe(self, seq_id: int, first_position: int, hidden: torch.Tensor) -> None:
        """Append hidden states; keep only a contiguous run of the last ``window`` positions."""
        start, old = self.history.get(seq_id, (first_position, hidden[:0]))
        if start + old.shape[0] != first_position:  # a gap (speculation paused): start again
            start, old = first_position, hidden[:0]
        both = torch.cat([old, hidden.detach()])[-self.window :]
        self.history[seq_id] = (first_position + hidden.shape[0] - both.shape[0], both)

    def forget(self, live: set[int]) -> None:
        """Drop finished or preempted-and-gone sequences' hidden states."""
        for sid in [s for s in self.history if s not in live]:
            del self.history[sid]

    @torch.no_grad()
    def propose(self, requests: Seq[DraftRequest], rows: SamplingRows, k: int) -> Drafts:
        """See ``Drafter.propose``."""
        dev = rows.keys.device
        b = len(requests)
        ready = [self._window_of(req) for req in requests]
        if k == 0 or not any(w is not None for w in ready):
            return Drafts(
                tokens=torch.zeros(b, max(k, 1), dtype=torch.int64, device=dev),
                num_drafts=torch.zeros(b, dtype=torch.int64, device=dev),
            )
        ids, hid, pos, mask = self._batch(requests, ready, dev)
        counts = torch.tensor(
            [r.max_drafts if w is not None else 0 for r, w in zip(requests, ready, strict=True)],
            dtype=torch.int64,
            device=dev,
        ).clamp(max=k)
        k_draft = purpose_keys(rows.keys, _DRAFT)
        tokens, probs = [], []
        layer = self.model.mtp_layers[0]
        last_pos = pos[:, -1]
        for j in range(k):
            h, logits = layer(self.model, hid, ids, pos, mask)
            q = policy_probs(logits[:, -1:], rows)[:, 0]
            d = draw(q, uniform_no_sync(k_draft, last_pos + 1 + j))
            tokens.append(d)
            probs.append(q)
            ids = torch.cat([ids, d[:, None]], 1)
            hid = torch.cat([hid, h[:, -1:]], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            mask = torch.cat([mask, mask[:, -1:]], 1)
        return Drafts(tokens=torch.stack(tokens, 1), num_drafts=counts, probs=torch.stack(probs, 1))

    def _window_of(self, req: DraftRequest) -> tuple[int, torch.Tensor] | None:
        """(first position, hidden [n, H]) ending at the last fed position (len(context) - 2), or None."""
        got = self.history.get(req.seq_id)
        if got is None or req.max_drafts == 0:
            return None
        start, h = got
        end = len(req.context) - 2  # the last position the policy has fed
        if start + h.shape[0] - 1 != end:
            return None
        return start, h

    def _batch(self, requests, ready, dev):
        """Left-padded MTP inputs: next_ids t_{i+1}, hidden h_i, positions i + 1, mask [B, W]."""
        w = max(h.shape[0] for r in ready if r is not None for h in [r[1]])
        hsz = next(r[1].shape[1] for r in ready if r is not None)
        dtype = next(r[1].dtype for r in ready if r is not None)
        ids = torch.zeros(len(requests), w, dtype=torch.int64)
        pos = torch.zeros(len(requests), w, dtype=torch.int64)
        mask = torch.zeros(len(requests), w, dtype=torch.int64)
        hid = torch.zeros(len(requests), w, hsz, dtype=dtype, device=dev)
        for r, (req, got) in enumerate(zip(requests, ready, strict=True)):
            if got is None:
                mask[r, -1] = 1  # a dummy row: one position attending itself
                continue
            start, h = got
            n = h.shape[0]
            ids[r, w - n :] = torch.tensor(req.context[start + 1 : start + 1 + n], dtype=torch.int64)
            pos[r, w - n :] = torch.arange(start + 1, start + 1 + n)
            mask[r, w - n :] = 1
            hid[r, w - n :] = h
        return ids.to(dev), hid, pos.to(dev), mask.to(dev)


# -- When to speculate ---------------------------------------------------------------------------


@dataclass(slots=True)
class SpecPolicy:
    """Whether an engine step speculates: not above ``max_batch`` running sequences (a large batch is
    compute-bound: verifying k + 1 tokens per row costs about k + 1 decode steps), and not while the
    acceptance rate of the last ``window`` speculative steps is below ``min_acceptance`` (drafts that are
    mostly rejected only add work) -- then one probe step every ``probe_every`` steps measures it again.
    Counters say which rule held each step (tests and metrics read them, never timings)."""

    max_batch: int = 32
    min_acceptance: float = 0.2
    probe_every: int = 16
    window: int = 16
    recent: deque = field(default_factory=deque)
    """(drafted, accepted, emitted) of the last ``window`` speculative steps, newest last."""
    num_spec_steps: int = 0
    num_off_batch: int = 0
    """Steps not speculated because the batch was above ``max_batch``."""
    num_off_acceptance: int = 0
    """Steps not speculated because the recent acceptance rate was too low."""
    _since_probe: int = 0

    def should_speculate(self, num_running: int) -> bool:
        """Decide for a step of ``num_running`` sequences (counts the decision)."""
        if num_running > self.max_batch:
            self.num_off_batch += 1
            return False
        rate = self.acceptance_rate
        if rate is not None and rate < self.min_acceptance:
            self._since_probe += 1
            if self._since_probe < self.probe_every:
                self.num_off_acceptance += 1
                return False
            self._since_probe = 0
        return True

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """One speculative step's totals over its rows."""
        self.recent.append((drafted, accepted, emitted))
        while len(self.recent) > self.window:
            self.recent.popleft()
        self.num_spec_steps += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted over the recent steps that drafted anything (None: none yet)."""
        drafted = sum(d for d, _, _ in self.recent)
        return sum(a for _, a, _ in self.recent) / drafted if drafted else None

    @property
    def accepted_per_step(self) -> float | None:
        """Mean accepted drafts per row and speculative step over the recent steps (None: none yet)."""
        rows = sum(e - a for _, a, e in self.recent)  # each row emits accepted + 1
        return sum(a for _, a, _ in self.recent) / rows if rows else None


@dataclass(slots=True)
class SpecTimer:
    """Seconds spent drafting (``timing/spec_draft_s``), cumulative."""

    draft_s: float = 0.0
    _t0: float = 0.0

    def __enter__(self) -> SpecTimer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.draft_s += time.perf_counter() - self._t0
