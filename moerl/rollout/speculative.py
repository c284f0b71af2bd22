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
hidden state, on the device from a ring of the policy's hidden states). ``SpecPolicy`` decides per
engine step whether to speculate at all (batch size, the recent acceptance rate, and the measured cost
of speculative against plain steps).

``verify_drafts`` and ``MtpDrafter.draft_no_sync`` never wait for the device: the engine replays them,
with the verify forward, from one CUDA graph (``moerl.rollout.spec_decode``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moerl.rollout.sampler import (
    SamplingRows,
    hash_salt,
    mix32,
    truncation_mask,
    uniform_no_sync,
)

SPECULATIVE = ("off", "mtp", "ngram")
"""``rollout.speculative`` choices: no speculation, the MTP drafter, the n-gram (prompt lookup) drafter."""

_ACCEPT, _RESIDUAL, _DRAFT = 0xACCE, 0x2E51, 0xD2AF  # purposes of the counter-based uniforms


@dataclass(frozen=True, slots=True)
class StepNoise:
    """Every uniform one speculative step of B rows uses, drafted position j = 0..K at sequence position
    ``first_position + j``: the values of ``uniform_no_sync`` at (purpose key, position) for each purpose,
    so a step draws exactly what separate draws would, from one evaluation of the counter hash."""

    bonus: torch.Tensor
    """[B, K + 1] float64: the sampler's own uniforms (the row's sample key), for the token drawn from p_j."""
    draft: torch.Tensor
    """[B, K] float64: the drafter's draw of d_j (``_DRAFT``)."""
    accept: torch.Tensor
    """[B, K] float64: the accept test of d_j (``_ACCEPT``)."""
    residual: torch.Tensor
    """[B, K] float64: the draw from the residual at a rejection of d_j (``_RESIDUAL``)."""


def step_noise(keys: torch.Tensor, first_position: torch.Tensor, k: int) -> StepNoise:
    """All uniforms of a speculative step in one ``uniform_no_sync`` over a [B, 4K + 1] grid (rather than
    one call per purpose and drafted token: the hash is ~90 elementwise kernels, and a decode step at small
    batch costs what its kernel launches cost). No host sync.

    Args:
        keys: [B] int64 sample keys (``SamplingRows.keys``).
        first_position: [B] int64 sequence position of the step's first emitted token.
        k: K, drafted tokens per row.
    Returns:
        ``StepNoise``; entry (b, j) of each field equals ``uniform_no_sync(hash_combine(keys[b], purpose),
        first_position[b] + j)`` with its purpose's constant (``keys[b]`` itself for ``bonus``): no two
        purposes share a uniform.
    """
    b = keys.shape[0]
    salts = [hash_salt(purpose) for purpose in (_DRAFT, _ACCEPT, _RESIDUAL)]  # host ints
    purposes = mix32(torch.stack([keys ^ s for s in salts], 1))  # [B, 3]: hash_combine(keys, each)
    grid_keys = torch.cat([keys[:, None].expand(b, k + 1), purposes.repeat_interleave(k, dim=1)], 1)
    j = torch.arange(k + 1, device=keys.device)
    u = uniform_no_sync(grid_keys, first_position[:, None] + torch.cat([j, j[:k].repeat(3)]))
    return StepNoise(
        bonus=u[:, : k + 1],
        draft=u[:, k + 1 : 2 * k + 1],
        accept=u[:, 2 * k + 1 : 3 * k + 1],
        residual=u[:, 3 * k + 1 :],
    )


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
        keep = truncation_mask(scaled, _repeat(rows.top_k, j), _repeat(rows.top_p, j))
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
    noise: StepNoise,
) -> Verified:
    """Accept or reject each row's drafts by the rejection-sampling rule (module docstring; Leviathan et
    al. 2023 Algorithm 1, Chen et al. 2023 Algorithm 2), so each emitted token has the policy's
    distribution. Every branch (accept test, residual draw, the sampler's own draw) is computed for every
    row and position and selected on the device: no host sync, fixed shapes (a CUDA graph holds it).

    Args:
        target_logits: [B, K + 1, V] the policy's logits at the positions of [t, d_0, ..., d_{K-1}]:
            position j predicts the token after d_{j-1}.
        drafts: [B, K] int64 drafted tokens (entries past ``num_drafts`` are ignored).
        draft_probs: [B, K, V] the draft distributions q_j the drafts were drawn from; None: the drafts
            are deterministic (q_j = one-hot(d_j)).
        num_drafts: [B] int64 k_b <= K drafts of each row.
        rows: the rows' sampling parameters.
        noise: the step's uniforms, ``step_noise(rows.keys, first_position, K)`` with first_position [B]
            int64 the sequence position of each row's first emitted token (the noise counter).
    Returns:
        ``Verified``.
    """
    b, k1, v = target_logits.shape
    k = k1 - 1
    # every branch for every row, selected below without a host sync (a CUDA graph can hold it):
    # the sampler's own draw at each position (the token after the last accepted draft when the row
    # has no draft left there: a plain decode step when k_b = 0; the same distribution, uniform and
    # inverse-CDF arithmetic as ``sample_no_sync``, so the same token) ...
    p_all = policy_probs(target_logits, rows)  # [B, K + 1, V]
    bonus = draw(p_all.reshape(b * k1, v), noise.bonus.reshape(-1)).view(b, k1)
    greedy = rows.temperature == 0.0
    temp = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature).float()
    scaled = target_logits.float() / temp[:, None, None]
    num_drafts = num_drafts.to(torch.int64)
    tokens = bonus
    accepted = torch.zeros_like(num_drafts)
    if k > 0:  # ... the accept test and the residual draw at each drafted position
        d = drafts[:, :k]
        p = p_all[:, :k]  # [B, K, V]
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(-1, d[..., None], 1.0)
        else:
            q = draft_probs[:, :k].double()
        p_d = p.gather(-1, d[..., None]).squeeze(-1)
        q_d = q.gather(-1, d[..., None]).squeeze(-1).clamp(min=1e-300)
        ok = noise.accept < p_d / q_d
        residual = (p - q).clamp(min=0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q up to rounding
        fixed = draw(residual.reshape(b * k, v), noise.residual.reshape(-1)).view(b, k)
        j = torch.arange(k, device=d.device)
        has_draft = j[None, :] < num_drafts[:, None]
        accepted = (has_draft & ok).long().cumprod(-1).sum(-1)  # a: the leading accepted drafts
        at = torch.arange(k1, device=d.device)[None, :]
        rejected = torch.cat([fixed, fixed[:, :1]], 1)  # position K has no draft (a bonus there)
        last = torch.where((accepted < num_drafts)[:, None], rejected, bonus)  # token at position a
        drafted = torch.cat([d, d[:, :1]], 1)
        tokens = torch.where(at < accepted[:, None], drafted, torch.where(at == accepted[:, None], last, 0))
    logp = scaled.gather(-1, tokens[..., None]).squeeze(-1) - scaled.logsumexp(-1)
    return Verified(tokens=tokens, logprobs=logp, num_accepted=accepted)


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B] -> [B * n], each entry ``n`` times in place (``repeat_interleave`` by a view: no host sync)."""
    return x[:, None].expand(x.shape[0], n).reshape(-1)


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
    """Proposes tokens on the host for a batch of rows (the n-gram drafter): the engine copies them into
    the verify step's device buffer. (The MTP drafter drafts on the device: ``MtpDrafter``.)"""

    def propose(self, requests: Seq[DraftRequest], rows: SamplingRows, k: int) -> Drafts:
        """At most ``k`` drafts per row (each row's ``max_drafts`` caps it); host tensors."""
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
        return Drafts(tokens=out, num_drafts=counts)  # host tensors: the engine copies them over

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


class MtpDrafter:
    """Drafts on the device from the policy's MTP module (``moerl.models.mtp``): d_0 from (Emb(t), h) of
    the last fed position, then d_j from (Emb(d_{j-1}), h^mtp_{j-1}) (the layer chained on its own
    output, as vLLM does for k > depth). Drafts are sampled from q = ``policy_probs`` of the MTP logits
    (greedy rows: its argmax) with the counter-based uniforms of purpose ``_DRAFT``.

    The MTP block attends over the last ``window`` fed positions (recomputed each draft, no cache of its
    own), read from a device ring per engine row: the policy's final hidden state h_i and the token
    t_{i+1} after each fed position i, written by the prefill (``keep_prefill``), by every plain decode
    step and by the verify step (``keep_no_sync``); so every running sequence can
    draft at every step, with fixed shapes per (B, k) and no host sync (a CUDA graph holds it).

    Ring: C = ``window`` + K + 1 columns per row, position i in column i mod C, so the verify's writes (at
    the K + 1 positions after the window) never overwrite what the same step's draft reads (running the
    step twice, as a CUDA-graph capture does, reads the same window).

    Args:
        model: the policy (its ``mtp_layers[0]``; embedding, head and rotary are the policy's).
        window: W, fed positions the MTP block attends over.
    Raises:
        ValueError: the model has no MTP layer.
    """

    on_device = True

    def __init__(self, model: torch.nn.Module, window: int = 32) -> None:
        if not len(getattr(model, "mtp_layers", ())):
            raise ValueError("rollout.speculative=mtp needs a policy with an MTP layer (moerl.models.mtp)")
        self.model = model
        self.window = window
        self.columns = window + 1  # C, set by ``allocate`` (window + K + 1)
        self.hidden: torch.Tensor | None = None
        """[N, C, H] model dtype: h_i of fed position i in column i mod C."""
        self.next_ids: torch.Tensor | None = None
        """[N, C] int64: t_{i+1}, the token after fed position i, beside its hidden state."""
        self.first_position: torch.Tensor | None = None
        """[N] int64: the oldest position the row's ring holds for its sequence (its prefill's first)."""

    @property
    def row_state(self) -> list[torch.Tensor]:
        """The per-row device tensors (moved with their row on compaction; none before ``allocate``)."""
        return [] if self.hidden is None else [self.hidden, self.next_ids, self.first_position]

    def allocate(self, num_rows: int, num_tokens: int, hidden: torch.Tensor) -> None:
        """The ring of ``num_rows`` engine rows for K = ``num_tokens`` drafts, in ``hidden``'s dtype,
        size and device (once)."""
        if self.hidden is not None:
            return
        self.columns = self.window + num_tokens + 1
        dev = hidden.device
        self.hidden = hidden.new_zeros(num_rows, self.columns, hidden.shape[-1])
        self.next_ids = torch.zeros(num_rows, self.columns, dtype=torch.int64, device=dev)
        self.first_position = torch.zeros(num_rows, dtype=torch.int64, device=dev)

    def keep_no_sync(
        self, rows: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> None:
        """Write (h_i, t_{i+1}) of fed positions into the ring, no host sync.

        Args:
            rows: [R] int64 engine rows. positions: [R] int64 fed positions i. hidden: [R, H].
            next_ids: [R] int64 t_{i+1}.
        """
        idx = rows * self.columns + positions.remainder(self.columns)
        self.hidden.view(-1, self.hidden.shape[-1]).index_copy_(0, idx, hidden.to(self.hidden.dtype))
        self.next_ids.view(-1).index_copy_(0, idx, next_ids)

    def keep_prefill(
        self,
        rows: list[int],
        first: list[int],
        ids: list[list[int]],
        hidden: torch.Tensor,
        hidden_row: list[int],
        last_ids: torch.Tensor,
    ) -> None:
        """A prefill's fed positions into the ring (host-built indices: once per admission).

        Args:
            rows: engine row of each sequence S. first: its first fed position (the prefix-cache hit).
            ids: its fed tokens ``tokens[first:]`` (host). hidden: [R, T, H] the prefill's final hidden
                states; sequence s's are row ``hidden_row[s]`` (positions ``first[s] ..``; a group's
                samples share one). last_ids: [S] int64 on the device, the token after each sequence's
                last fed position (the first sampled token, or a resumed sequence's last).
        """
        s_of, r_of, t_of, pos, nxt = [], [], [], [], []
        for s, (f, toks) in enumerate(zip(first, ids, strict=True)):
            n = len(toks)
            for t in range(max(0, n - self.window), n):  # the last ``window`` positions only
                s_of.append(s)
                r_of.append(hidden_row[s])
                t_of.append(t)
                pos.append(f + t)
                nxt.append(toks[t + 1] if t + 1 < n else -1)
        dev = hidden.device
        s_t, pos_t = torch.tensor(s_of, device=dev), torch.tensor(pos, device=dev)
        nxt_t = torch.tensor(nxt, dtype=torch.int64, device=dev)
        nxt_t = torch.where(nxt_t < 0, last_ids[s_t], nxt_t)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        h = hidden[torch.tensor(r_of, device=dev), torch.tensor(t_of, device=dev)]
        self.keep_no_sync(rows_t[s_t], pos_t, h, nxt_t)
        self.first_position[rows_t] = torch.tensor(first, dtype=torch.int64, device=dev)

    @torch.no_grad()
    def draft_no_sync(
        self, last_fed: torch.Tensor, rows: SamplingRows, k: int, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` drafts for engine rows 0..B-1, whose last fed positions are ``last_fed`` [B] int64 (the
        token after it, t, is the next input); ``u`` [B, k] float64 the uniforms of the draws
        (``StepNoise.draft`` of ``step_noise(rows.keys, last_fed + 2, k)``); no host sync.

        Returns:
            drafts [B, k] int64, q [B, k, V] float64 (the distributions they were drawn from).
        """
        b, w = last_fed.shape[0], self.window
        p = last_fed[:, None] - (w - 1) + torch.arange(w, device=last_fed.device)  # [B, W] fed positions
        col = p.remainder(self.columns)
        hid = self.hidden[:b].gather(1, col[..., None].expand(b, w, self.hidden.shape[-1]))
        ids = self.next_ids[:b].gather(1, col)
        valid = (p >= self.first_position[:b, None]) & (p >= 0)
        pos = (p + 1).clamp(min=0)  # the positions of next_ids (rotary)
        layer = self.model.mtp_layers[0]
        tokens, probs = [], []
        for j in range(k):
            t = ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=p.device).tril()
            mask = (causal[None] & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=p.device)
            h, logits = layer.forward_last(self.model, hid, ids, pos, mask[:, None])  # [B, 1, H], [B, 1, V]
            q = policy_probs(logits, rows)[:, 0]
            d = draw(q, u[:, j])
            tokens.append(d)
            probs.append(q)
            ids = torch.cat([ids, d[:, None]], 1)
            hid = torch.cat([hid, h], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            valid = torch.cat([valid, valid.new_ones(b, 1)], 1)
        if not tokens:
            v = self.model.config.vocab_size
            return last_fed.new_zeros(b, 0), torch.zeros(b, 0, v, dtype=torch.float64, device=last_fed.device)
        return torch.stack(tokens, 1), torch.stack(probs, 1)


# -- When to speculate ---------------------------------------------------------------------------


@dataclass(slots=True)
class SpecPolicy:
    """Whether an engine step speculates. Three rules, checked in this order:

    - batch: not above ``max_batch`` running sequences (a large batch is compute-bound: verifying k + 1
      tokens per row costs about k + 1 decode steps);
    - acceptance: not while the acceptance rate of the last ``window`` speculative steps is below
      ``min_acceptance`` (drafts that are mostly rejected only add work);
    - cost: not while speculation is measured slower than plain decoding: tokens per row and second of
      the last ``window`` measured runs of speculative steps below those of the last ``window`` runs of
      plain steps. A run is the steps between two host reads that only steps of one kind lay between
      (``at_sync``), timed by the host's wall clock from one read to the next; a plain step emits one
      token per row, a speculative step the mean emitted tokens per row of the recent steps read
      (``record``). A step drafted on the host (n-gram) reads its own tokens, and is timed from its start
      to that read (``note_spec``). Every time is read at a host read the engine makes anyway, so
      measuring adds no device sync.

    While the acceptance or the cost rule holds, one probe step every ``probe_every`` steps speculates
    and measures again; while speculating, one plain step after every ``probe_every`` speculative ones
    keeps the plain measurement current (``num_plain_probes``). Counters say which rule held each step (tests and metrics read them; tests
    inject ``clock``, never read timings).
    """

    max_batch: int = 32
    min_acceptance: float = 0.2
    probe_every: int = 16
    window: int = 16
    clock: Callable[[], float] = time.perf_counter
    """Host seconds (injected by tests)."""
    recent: deque = field(default_factory=deque)
    """(drafted, accepted, emitted) of the last ``window`` speculative steps, newest last."""
    num_spec_steps: int = 0
    num_off_batch: int = 0
    """Steps not speculated because the batch was above ``max_batch``."""
    num_off_acceptance: int = 0
    """Steps not speculated because the recent acceptance rate was too low."""
    num_off_cost: int = 0
    """Steps not speculated because speculation was measured slower than plain decoding."""
    timed: dict = field(default_factory=lambda: {"spec": deque(), "plain": deque()})
    """kind -> (tokens per row, seconds, steps) of the last ``window`` measurements, newest last."""
    totals: dict = field(default_factory=lambda: {"spec": [0.0, 0], "plain": [0.0, 0]})
    """kind -> [seconds, steps] of every measurement (``mean_step_ms``)."""
    num_plain_probes: int = 0
    """Plain steps run to measure plain decoding: one after every ``probe_every`` speculative steps."""
    _since_probe: int = 0
    _spec_in_a_row: int = 0
    _segment: list = field(default_factory=lambda: [0, False, None, 0])  # plain, mixed, start, spec

    def should_speculate(self, num_running: int) -> bool:
        """Decide for a step of ``num_running`` sequences (counts the decision)."""
        if num_running > self.max_batch:
            self.num_off_batch += 1
            self._spec_in_a_row = 0
            return False
        rate = self.acceptance_rate
        low = rate is not None and rate < self.min_acceptance
        slow = not low and self.is_slower()
        if low or slow:
            self._since_probe += 1
            if self._since_probe < self.probe_every:
                if low:
                    self.num_off_acceptance += 1
                else:
                    self.num_off_cost += 1
                self._spec_in_a_row = 0
                return False
            self._since_probe = 0
        self._spec_in_a_row += 1
        if self._spec_in_a_row > self.probe_every:  # keep the plain steps' measurement current
            self._spec_in_a_row = 0
            self.num_plain_probes += 1
            return False
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

    # -- Cost: measured at host syncs -----------------------------------------------------------

    def at_sync(self) -> None:
        """The host just read the device's tokens (an existing sync): close the run of steps since the
        previous one (measured when it held steps of one kind only: plain, or speculative once some
        speculative step's tokens were read)."""
        now = self.clock()
        plain, mixed, start, spec = self._segment
        if start is not None and not mixed and bool(plain) != bool(spec):
            if plain:
                self._measured("plain", float(plain), now - start, plain)
            elif self.recent:
                self._measured("spec", spec * self.emitted_per_row, now - start, spec)
        self._segment[:] = [0, False, now, 0]

    def note_plain(self, steps: int) -> None:
        """``steps`` plain decode steps ran since the last host sync."""
        self._segment[0] += steps

    def note_spec_step(self) -> None:
        """A speculative step ran since the last host sync, its tokens not read yet (timed by ``at_sync``)."""
        self._segment[3] += 1

    @property
    def plain_since_sync(self) -> bool:
        """Whether plain steps ran since the last host sync (a speculative run then starts with a read)."""
        return bool(self._segment[0])

    @property
    def emitted_per_row(self) -> float:
        """Mean tokens a row emitted per speculative step over the recent steps read (1.0: none yet)."""
        accepted = self.accepted_per_step
        return 1.0 if accepted is None else 1.0 + accepted

    def note_other(self) -> None:
        """Other device work (a prefill) ran since the last host sync: that run is not measured."""
        self._segment[1] = True

    def note_spec(self, tokens_per_row: float, seconds: float) -> None:
        """One speculative step: its emitted tokens per row, and host seconds from its start to its sync."""
        self._measured("spec", tokens_per_row, seconds, 1)

    def _measured(self, kind: str, tokens_per_row: float, seconds: float, steps: int) -> None:
        recent = self.timed[kind]
        recent.append((tokens_per_row, max(seconds, 0.0), steps))
        while len(recent) > self.window:
            recent.popleft()
        self.totals[kind][0] += max(seconds, 0.0)
        self.totals[kind][1] += steps

    def tokens_per_row_s(self, kind: str) -> float | None:
        """Tokens per row and second of the recent ``kind`` (``spec``, ``plain``) measurements (None:
        none yet, or no time measured)."""
        recent = self.timed[kind]
        seconds = sum(s for _, s, _ in recent)
        return sum(t for t, _, _ in recent) / seconds if recent and seconds > 0 else None

    def is_slower(self) -> bool:
        """Whether the recent speculative steps made fewer tokens per row and second than plain steps."""
        spec, plain = self.tokens_per_row_s("spec"), self.tokens_per_row_s("plain")
        return spec is not None and plain is not None and spec < plain

    def mean_step_ms(self, kind: str) -> float | None:
        """Mean host milliseconds per measured ``kind`` step since the start (None: none measured)."""
        seconds, steps = self.totals[kind]
        return 1e3 * seconds / steps if steps else None


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
