"""The engine's speculative decode step: draft, verify in one forward, accept, record.

Shapes: B running sequences, K = ``rollout.speculative_tokens``, V vocabulary, H hidden size.

``SpeculativeDecoding`` is a component the engine holds (``Engine.speculation``; None when
``rollout.speculative=off``), over a cache policy that can reserve room for drafts
(``PagedCachePolicy.room_for_drafts``); ``Engine.step`` asks it, once per step, whether to speculate
(``SpecPolicy``) and then calls ``step(engine)`` instead of the plain decode. One speculative step:

1. the host learns every pending token (a sync; drafting needs the context on the host);
2. the drafter proposes k_b <= K tokens per row (fewer near ``max_new_tokens``, or where the cache has
   no block for them);
3. one forward over [t, d_0, ..., d_{k_b - 1}] per row, through the engine's prefill path
   (``Engine._forward_prefill``: each row attends over its cached prefix and writes the keys,
   values and, with R3, the routed experts of those positions into its blocks);
4. ``moerl.rollout.speculative.verify_drafts`` keeps a_b drafts and adds one token (exact policy
   distribution); the a_b + 1 tokens are recorded with the policy's log-probs and the step's version;
5. the sequence's length advances by a_b + 1 and its last token becomes the next input. Positions of
   rejected drafts were written but lie beyond the length: never read, and overwritten (keys, values and
   routed experts) by the next step, which starts at the first of them -- so R3 records are those of
   accepted tokens only;
6. the new tokens are synced (stop tokens and length limits as in a plain step).

The step runs eagerly (no CUDA graph): its shapes vary with the drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerl.rollout.cache_policy import PrefillRow
from moerl.rollout.params import Completion
from moerl.rollout.speculative import (
    Drafter,
    DraftRequest,
    MtpDrafter,
    NgramDrafter,
    SpecPolicy,
    SpecTimer,
    verify_drafts,
)

if TYPE_CHECKING:
    from moerl.config import RolloutConfig
    from moerl.rollout.engine import Engine
    from moerl.rollout.scheduler import Sequence


def make_drafter(kind: str, model: torch.nn.Module) -> Drafter:
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
        drafter: proposes the drafts (``moerl.rollout.speculative.Drafter``).
        num_tokens: K, drafts per sequence and step at most.
        policy: decides which steps speculate; default ``SpecPolicy()``.
    """

    def __init__(self, drafter: Drafter, num_tokens: int, policy: SpecPolicy | None = None) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.policy = policy or SpecPolicy()
        self.timer = SpecTimer()
        self.num_drafted = 0
        self.num_accepted = 0

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
        """Whether the drafter conditions on the policy's hidden states (the MTP drafter)."""
        return isinstance(self.drafter, MtpDrafter)

    def observe_prefill(self, admissions, hidden: torch.Tensor) -> None:
        """Hand a prefill's hidden states [R, T, H] (row r: positions ``cached ..`` of admission r's tokens)
        to the drafter for every sequence of the admission (a group's samples share its prompt)."""
        for r, a in enumerate(admissions):
            n = len(a.tokens) - a.cached
            for s in a.sequences:
                self.drafter.observe(id(s), a.cached, hidden[r, :n])

    def should_speculate(self, engine: Engine) -> bool:
        """Whether this engine step speculates (``SpecPolicy.should_speculate`` on the running count)."""
        return self.policy.should_speculate(len(engine.scheduler.running))

    def step(self, engine: Engine) -> list[Completion]:
        """One speculative decode step of every running sequence; returns the completions it finished."""
        done = engine._sync_all()
        seqs = list(engine.scheduler.running)
        if not seqs:
            return done
        dev = engine.device
        slot_idx = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev)
        rows = engine._rows(slot_idx, seqs)
        contexts = [list(s.request.prompt_ids) + s.token_ids for s in seqs]
        requests = [
            DraftRequest(ctx, self._room(s), s.noise_key, id(s))
            for s, ctx in zip(seqs, contexts, strict=True)
        ]
        with self.timer:
            drafts = self.drafter.propose(requests, rows, self.num_tokens)
        counts = [
            engine.policy.room_for_drafts(s, n) for s, n in zip(seqs, drafts.num_drafts.tolist(), strict=True)
        ]
        k = max(counts)
        want_routed = any(s.request.params.return_routed_experts for s in seqs)
        want_hidden = self.wants_hidden
        draft_ids = drafts.tokens[:, :k].tolist() if k else [[] for _ in seqs]
        starts = [s.seq_len - 1 for s in seqs]
        rows_in = [
            PrefillRow(s, ctx + d[:n], s.seq_len - 1)
            for s, ctx, d, n in zip(seqs, contexts, draft_ids, counts, strict=True)
        ]
        logits, hidden = engine._forward_prefill(rows_in, want_routed, want_hidden=want_hidden)
        first = torch.tensor([s.seq_len for s in seqs], dtype=torch.int64, device=dev)
        probs = None if drafts.probs is None or k == 0 else drafts.probs[:, :k]
        ver = verify_drafts(
            logits[:, : k + 1],
            drafts.tokens[:, : max(k, 1)],
            probs,
            torch.tensor(counts, dtype=torch.int64, device=dev),
            rows,
            first,
        )
        accepted = ver.num_accepted.tolist()  # host sync: the step's lengths decide the next one
        self._record(engine, seqs, ver, accepted, slot_idx, first)
        if hidden is not None:
            for b, s in enumerate(seqs):
                self.drafter.observe(id(s), starts[b], hidden[b, : accepted[b] + 1])
        self.num_drafted += sum(counts)
        self.num_accepted += sum(accepted)
        self.policy.record(sum(counts), sum(accepted), sum(accepted) + len(seqs))
        done += engine._sync_all()
        self.drafter.forget({id(s) for s in engine.scheduler.running})
        return done

    def _room(self, seq: Sequence) -> int:
        """Drafts this sequence may take: K, fewer when its length limit is near (the step emits a + 1)."""
        left = seq.request.params.max_new_tokens - seq.num_generated - 1
        return max(0, min(self.num_tokens, left))

    @staticmethod
    def _record(engine: Engine, seqs, ver, accepted: list[int], slot_idx, first) -> None:
        """The emitted tokens as pending entries (one per position j: the rows that emitted a j-th token)
        and the rows' device state (last token, length)."""
        emitted = [a + 1 for a in accepted]
        for j in range(max(emitted)):
            idx = [b for b, e in enumerate(emitted) if e > j]
            sel = torch.tensor(idx, dtype=torch.int64, device=engine.device)
            engine._record([seqs[b] for b in idx], ver.tokens[sel, j], ver.logprobs[sel, j])
        n = torch.tensor(emitted, dtype=torch.int64, device=engine.device)
        engine._last_token[slot_idx] = ver.tokens[torch.arange(len(seqs), device=engine.device), n - 1]
        engine._seq_len[slot_idx] = first + n
        engine._decode_steps += 1
        engine._decode_rows += len(seqs)

    def stats(self) -> dict[str, float | int | None]:
        """``EngineStats`` fields of speculation (``spec_*``)."""
        return {
            "spec_steps": self.policy.num_spec_steps,
            "spec_drafted": self.num_drafted,
            "spec_accepted": self.num_accepted,
            "spec_acceptance_recent": self.policy.acceptance_rate,
            "spec_accepted_per_step_recent": self.policy.accepted_per_step,
            "spec_draft_s": self.timer.draft_s,
        }
