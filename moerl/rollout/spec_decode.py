"""The engine's speculative decode step: draft, verify in one decode-shaped forward, accept, record.

Shapes: B decode rows (the running sequences, rounded up to a batch bucket), K =
``rollout.speculative_tokens``, k <= K drafts this step, V vocabulary, H hidden size.

``SpeculativeDecoding`` is a component the engine holds (``Engine.speculation``; None when
``rollout.speculative=off``), over a cache policy that can reserve room for drafts and bind a verify
(``PagedCachePolicy.room_for_drafts``, ``bind_verify``); ``Engine.step`` asks it, once per step, whether
to speculate (``SpecPolicy``) and then calls ``step(engine)`` instead of the plain decode. One step:

1. the host gives each sequence room for k_b <= K drafts (fewer near ``max_new_tokens`` or where the
   cache has no free block; the n-gram drafter proposes on the host first, from the synced context);
2. one function, replayed from a CUDA graph keyed by (B, k, read length, sampling flags, R3), with no
   host sync (``forward_no_sync``): the MTP drafter drafts on the device from its ring of hidden states
   (``speculative.MtpDrafter``; the n-gram drafts come from a device buffer); the verify forward feeds
   each sequence's [t, d_0, ..., d_{k-1}] as k + 1 decode ROWS that share the sequence's block-table
   row, at positions pos .. pos + k (``verify_forward_no_sync``): every row writes its key and
   value (and, with R3, its routed experts) at its own position before the layer attends, so row j
   sees rows < j of its sequence; ``verify_drafts`` keeps a_b drafts and adds one token (exact policy
   distribution); the MTP ring takes the verify's hidden states;
3. outside the graph the rows' device state advances (last token, length) and the a_b + 1 tokens go
   to the host sync as one entry (``HostSync.record_several``). With the MTP drafter the step does not
   wait for them: the host reads at the engine's syncs, and plans meanwhile from upper bounds
   (``Sequence.unread``; the device stops each row at its ``max_new_tokens``). The n-gram drafter's
   step reads them at once (its next drafts need the context);
4. positions of rejected drafts were written but lie beyond the length: never read, and overwritten
   (keys, values, routed experts) by the next step, which starts at the first of them -- so R3 records
   are those of accepted tokens only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerl.rollout.cuda_graphs import GraphRunner
from moerl.rollout.params import Completion
from moerl.rollout.speculative import (
    Drafter,
    DraftRequest,
    MtpDrafter,
    NgramDrafter,
    SpecPolicy,
    SpecTimer,
    step_noise,
    verify_drafts,
)

if TYPE_CHECKING:
    from moerl.config import RolloutConfig
    from moerl.rollout.engine import Engine
    from moerl.rollout.sampler import SamplingRows
    from moerl.rollout.scheduler import Sequence


def make_drafter(kind: str, model: torch.nn.Module) -> Drafter | MtpDrafter:
    """The drafter of ``rollout.speculative`` (``mtp`` or ``ngram``).

    Raises:
        ValueError: an unknown kind, or ``mtp`` for a model without an MTP layer.
    """
    if kind == "ngram":
        return NgramDrafter()
    if kind == "mtp":
        return MtpDrafter(model)
    raise ValueError(f"rollout.speculative={kind!r} has no drafter; use mtp or ngram")


class SpeculativeDecoding:
    """Drafter, tokens per step and the when-to-speculate policy of one engine (module docstring).

    Args:
        drafter: proposes the drafts: a host ``speculative.Drafter`` or the device ``MtpDrafter``.
        num_tokens: K, drafts per sequence and step at most.
        policy: decides which steps speculate; default ``SpecPolicy()``.
    """

    def __init__(
        self, drafter: Drafter | MtpDrafter, num_tokens: int, policy: SpecPolicy | None = None
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.policy = policy or SpecPolicy()
        self.timer = SpecTimer()
        self.num_drafted = 0
        self.num_accepted = 0
        self._draft_tokens: torch.Tensor | None = None  # [N, K] int64 host drafts (static: graph input)
        self._num_drafts: torch.Tensor | None = None  # [N] int64 k_b of each row (static: graph input)
        self._end_len: torch.Tensor | None = None  # [N] int64 prompt + max_new of each row (graph input)
        self._row_plan: torch.Tensor | None = None  # [2, N]: _num_drafts and _end_len, one buffer
        self.graphs: GraphRunner | None = None
        """CUDA graphs of the speculative step (``forward_no_sync``), one per (B, k, read length, sampling
        flags, R3) key; None off CUDA or with the engine's graphs off."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RolloutConfig) -> SpeculativeDecoding | None:
        """The component of ``rollout.speculative`` (None: ``off``)."""
        if cfg.speculative == "off":
            return None
        return cls(
            make_drafter(cfg.speculative, model),
            cfg.speculative_tokens,
            SpecPolicy(max_batch=cfg.speculative_max_batch),
        )

    @property
    def wants_hidden(self) -> bool:
        """Whether the drafter conditions on the policy's hidden states (the MTP drafter's ring)."""
        return isinstance(self.drafter, MtpDrafter)

    @property
    def row_state(self) -> list[torch.Tensor]:
        """Per-row device tensors that move with their row on compaction (the MTP ring)."""
        return self.drafter.row_state if isinstance(self.drafter, MtpDrafter) else []

    # -- Hidden states for the MTP drafter (prefill and plain decode) -----------------------------

    def keep_prefill(self, engine: Engine, admissions, hidden: torch.Tensor) -> None:
        """A prefill's hidden states [R, T, H] (row r: positions ``cached ..`` of admission r's tokens)
        into the MTP ring of every sequence of the admission (a group's samples share its prompt), with
        the token after each position (the last: the sequence's next input, already set)."""
        if not isinstance(self.drafter, MtpDrafter):
            return
        self.drafter.allocate(engine.num_slots, self.num_tokens, hidden)
        rows, first, ids, of = [], [], [], []
        for r, a in enumerate(admissions):
            for s in a.sequences:
                rows.append(s.slot)
                first.append(a.cached)
                ids.append(a.tokens[a.cached :])
                of.append(r)
        slots = torch.tensor(rows, dtype=torch.int64, device=engine.device)
        self.drafter.keep_prefill(rows, first, ids, hidden, of, engine._last_token[slots])

    def keep_decode_no_sync(self, b: int, positions: torch.Tensor, hidden: torch.Tensor, tokens) -> None:
        """A plain decode step's hidden states [B, H] at ``positions`` [B] and its sampled tokens [B] into
        the MTP ring of rows 0..B-1 (inside the decode's CUDA graph; no host sync)."""
        if isinstance(self.drafter, MtpDrafter) and self.drafter.hidden is not None:
            rows = torch.arange(b, device=positions.device)
            self.drafter.keep_no_sync(rows, positions, hidden, tokens)

    # -- The step ----------------------------------------------------------------------------------

    def should_speculate(self, engine: Engine) -> bool:
        """Whether this engine step speculates (``SpecPolicy.should_speculate`` on the running count)."""
        return self.policy.should_speculate(len(engine.scheduler.running))

    def step(self, engine: Engine) -> list[Completion]:
        """One speculative decode step of every running sequence; returns the completions it finished.
        Falls back to a plain decode step when no sequence has a draft.

        With the device drafter (MTP) the step does not read its tokens: it plans from each sequence's
        upper bound (``Sequence.unread``) and the engine reads at its usual host syncs, so the host plans
        the next step while the device runs this one. A host drafter (n-gram) needs the whole context:
        its step reads everything pending first and its own tokens at its end."""
        lagged = self.on_device
        done = [] if lagged else engine._sync_all()  # the n-gram drafter reads the context
        if lagged and engine.host.has_several and self.policy.plain_since_sync:
            done += engine._read_exact()  # a run of speculative steps starts at a host read: timed
        self._buffers(engine)
        start = self.policy.clock()
        planned = self._plan(engine)
        if planned is None and engine.host.has_several:  # a worst-case length outgrew its blocks: read
            done += engine._read_exact()
            planned = self._plan(engine)
        if planned is None:
            return done
        seqs, rows, counts = planned
        a, b = len(seqs), engine._bucket(len(seqs))
        k = max(counts)
        if k == 0:  # nothing drafted (no n-gram match, or no room): a plain step, from exact lengths
            return done + engine._plain_step()
        ahead = max(s.unread for s in seqs)
        read_len = engine._read_len(seqs, extra=k + ahead)
        want_routed = any(s.request.params.return_routed_experts for s in seqs)
        fn = lambda: self.forward_no_sync(engine, b, k, read_len, rows, want_routed)  # noqa: E731
        graphs = self.graphs
        if graphs is not None and (not want_routed or engine.cache.routed is not None):
            key = ("verify", k, b, read_len, rows.all_greedy, rows.any_truncation, want_routed)
            tokens, logprobs, accepted = graphs.run(key, fn)
        else:
            tokens, logprobs, accepted = fn()
        emitted = accepted + 1  # advanced outside the graph: a capture's warm-up runs the step once more
        last = tokens.gather(1, (emitted - 1).clamp(min=0)[:, None])[:, 0]
        engine._last_token[:b] = torch.where(emitted > 0, last, engine._last_token[:b])
        engine._seq_len[:b] += emitted * engine._active[:b]
        bounds = [c + 1 for c in counts]
        entry = engine.host.record_several(
            seqs, tokens[:a], logprobs[:a], emitted[:a], engine.version, bounds
        )
        engine._decode_steps += 1
        engine._decode_rows += a
        self.num_drafted += sum(counts)
        if lagged:  # read at the engine's next host sync (``Engine.step``)
            engine.host.steps += 1
            self.policy.note_spec_step()
            return done
        done += engine._sync_all()  # the step's host sync: its counts and tokens, with every pending one
        self.policy.note_spec(sum(entry.emitted_read) / a, self.policy.clock() - start)
        return done

    @property
    def on_device(self) -> bool:
        """Whether the drafter drafts on the device (MTP): its steps plan without reading their tokens."""
        return isinstance(self.drafter, MtpDrafter)

    def _plan(self, engine: Engine) -> tuple[list[Sequence], SamplingRows, list[int]] | None:
        """The running sequences, their sampling rows and drafts k_b (``_plan_drafts``); None when
        nothing runs, or when some sequence's worst-case length no longer fits its blocks."""
        seqs = list(engine.scheduler.running)
        if not seqs:
            return None
        rows = engine._rows(slice(0, engine._bucket(len(seqs))), seqs)
        counts = self._plan_drafts(engine, seqs, rows)
        return None if counts is None else (seqs, rows, counts)

    def _read_several(self, entry) -> None:
        """A speculative step's counts, read by the host (``HostSync.on_several``): acceptance figures."""
        live = [(e, n) for e, n in zip(entry.emitted_read, entry.bounds, strict=True) if e > 0]
        emitted, rows = sum(e for e, _ in live), len(live)  # a row past its limit emitted nothing
        self.num_accepted += emitted - rows
        self.policy.record(sum(n for _, n in live) - rows, emitted - rows, emitted)

    def forward_no_sync(
        self, engine: Engine, b: int, k: int, read_len: int, rows: SamplingRows, want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft (on the device, or the host drafts' buffer), verify and accept for rows 0..b-1: the unit
        a CUDA graph captures per (b, k, read_len, flags) key. Reads the engine's per-row device state
        and this component's buffers; writes only the KV cache (and R3 records, the MTP ring) at
        positions past each row's length, the same values if run twice; never waits for the device.

        Returns:
            tokens [b, k + 1] int64, logprobs [b, k + 1] float32 (valid up to a_b + 1), a_b [b] int64.
        """
        first = engine._seq_len[:b]  # the position of each row's first emitted token
        # the device's own length limit: a row emits at most end - length tokens (none once there), so
        # steps planned from the host's upper bounds never pass a sequence's max_new_tokens
        left = self._end_len[:b] - first  # tokens each row may still emit
        live = left > 0
        num_drafts = torch.where(live, torch.minimum(self._num_drafts[:b], left - 1), -1)
        probs, noise = None, step_noise(rows.keys, first, k)  # the step's uniforms: one hash evaluation
        if isinstance(self.drafter, MtpDrafter):
            drafts, probs = self.drafter.draft_no_sync(first - 2, rows, k, noise.draft)
        else:
            drafts = self._draft_tokens[:b, :k]
        logits, hidden = verify_forward_no_sync(
            engine, b, k, read_len, drafts, num_drafts, want_routed, want_hidden=self.wants_hidden
        )
        ver = verify_drafts(logits, drafts, probs, num_drafts.clamp(min=0), rows, noise)
        if hidden is not None:  # the MTP ring: positions first - 1 .. first - 1 + k and their next tokens
            # (those past the a_b + 1 kept ones lie past the new last fed position: the next step
            # overwrites them before any draft reads them)
            j = torch.arange(k + 1, device=first.device)
            row = torch.arange(b, device=first.device)[:, None].expand(b, k + 1).reshape(-1)
            pos = (first[:, None] - 1 + j).reshape(-1)
            self.drafter.keep_no_sync(row, pos, hidden.flatten(0, 1), ver.tokens.reshape(-1))
        return ver.tokens, ver.logprobs, torch.where(live, ver.num_accepted, -1)

    def _plan_drafts(self, engine: Engine, seqs: list[Sequence], rows: SamplingRows) -> list[int] | None:
        """k_b of each sequence (host ints), with the blocks their drafted positions need at its
        worst-case length (``Sequence.unread`` past the host's); the n-gram drafter's tokens copied into
        the device buffer; both copies start without a host sync. None: some sequence's blocks do not
        reach its worst-case next position (the host must read first)."""
        if isinstance(self.drafter, MtpDrafter):
            if not self.drafter.row_state:  # no prefill has filled the ring yet (speculation set late)
                return [0] * len(seqs)
            counts = []
            for s in seqs:  # blocks up to the worst-case position, never past the sequence's last one
                want = min(s.unread + self._room(s), s.max_len - s.seq_len)
                fits = engine.policy.room_for_drafts(s, want)
                if fits < min(s.unread, want):
                    return None
                counts.append(max(0, fits - s.unread))
        else:
            reqs = [
                DraftRequest(list(s.request.prompt_ids) + s.token_ids, self._room(s), s.noise_key)
                for s in seqs
            ]
            with self.timer:
                drafts = self.drafter.propose(reqs, rows, self.num_tokens)
            found = drafts.num_drafts.cpu().tolist()  # host tensors (a host drafter): no device sync
            counts = [engine.policy.room_for_drafts(s, n) for s, n in zip(seqs, found, strict=True)]
            host = drafts.tokens.cpu()[:, : self.num_tokens]
            self._draft_tokens[: len(seqs), : host.shape[1]].copy_(_to_device_no_sync(host, engine.device))
        plan = torch.tensor([counts, [s.max_len for s in seqs]], dtype=torch.int64)
        self._row_plan.zero_()
        self._row_plan[:, : len(seqs)] = _to_device_no_sync(plan, engine.device)  # one copy a step
        return counts

    def _buffers(self, engine: Engine) -> None:
        """The static device buffers of the step (once per engine)."""
        if self._num_drafts is None:
            n, dev = engine.num_slots, engine.device
            self._draft_tokens = torch.zeros(n, self.num_tokens, dtype=torch.int64, device=dev)
            self._row_plan = torch.zeros(2, n, dtype=torch.int64, device=dev)
            self._num_drafts, self._end_len = self._row_plan[0], self._row_plan[1]
            # its own runner: a verify step that cannot be captured leaves the plain decode's graphs on
            self.graphs = GraphRunner(dev) if engine._graphs is not None else None
            engine.host.on_several = self._read_several

    def _room(self, seq: Sequence) -> int:
        """Drafts this sequence may take: K, fewer when its length limit is near (the step emits a + 1);
        from the host's count (tokens not read yet may leave fewer: the step clamps on the device)."""
        left = seq.request.params.max_new_tokens - seq.num_generated - 1
        return max(0, min(self.num_tokens, left))

    def stats(self) -> dict[str, float | int | None]:
        """``EngineStats`` fields of speculation (``spec_*``)."""
        pol = self.policy
        return {
            "spec_steps": pol.num_spec_steps,
            "spec_drafted": self.num_drafted,
            "spec_accepted": self.num_accepted,
            "spec_acceptance_recent": pol.acceptance_rate,
            "spec_accepted_per_step_recent": pol.accepted_per_step,
            "spec_draft_s": self.timer.draft_s,
            "spec_off_batch": pol.num_off_batch,
            "spec_off_acceptance": pol.num_off_acceptance,
            "spec_off_cost": pol.num_off_cost,
            "spec_step_ms": pol.mean_step_ms("spec"),
            "plain_step_ms": pol.mean_step_ms("plain"),
        }


def _to_device_no_sync(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; on CUDA from pinned memory without waiting (no host sync)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def verify_forward_no_sync(
    engine: Engine,
    b: int,
    k: int,
    read_len: int,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    want_routed: bool,
    *,
    want_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A speculative verify as one decode forward over b * (k + 1) rows (``moerl.rollout.spec_decode``):
    slot i's rows feed [t, d_0, ..., d_{k-1}] (t its last sampled token) at positions pos_i .. pos_i
    + k (pos_i = its length - 1), through its block-table row (``bind_verify``); rows past its
    ``num_drafts`` feed nothing (null block). Same contract as ``_decode_forward_no_sync``: device
    state only, no host sync, the same cache writes if run twice (CUDA-graph capturable).

    Args:
        drafts: [b, k] int64. num_drafts: [b] int64 k_i <= k.
    Returns:
        logits [b, k + 1, V] (row j predicts the token after position pos_i + j), and with
        ``want_hidden`` the final hidden states [b, k + 1, H] (else None).
    """
    k1, dev = k + 1, engine.device
    slot = torch.arange(b, device=dev)[:, None].expand(b, k1).reshape(-1)
    j = torch.arange(k1, device=dev).repeat(b)
    last = engine._seq_len[:b] - 1
    is_fed = j <= num_drafts[slot]
    pos = torch.where(is_fed, last[slot] + j, last[slot])  # a row not fed writes the null block
    ids = torch.cat([engine._last_token[:b, None], drafts], 1).reshape(-1)
    engine.policy.bind_verify(slot, pos, is_fed, read_len, k1)
    more = {"return_hidden": True} if want_hidden else {}  # only MoeForCausalLM knows it
    out = engine.model(
        ids[:, None], None, pos[:, None], cache=engine.cache, return_routed_experts=want_routed, **more
    )
    if want_routed:
        engine.policy.record_routed(out.routed_experts)  # [b * (k + 1), 1, Lm, K]
    engine.policy.unbind()
    hidden = out.hidden.view(b, k1, -1) if want_hidden else None
    return out.logits.view(b, k1, -1), hidden
