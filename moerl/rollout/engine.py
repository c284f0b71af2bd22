"""The rollout engine: continuous batching over a pluggable KV-cache policy, exact behaviour log-probs,
in-place weight updates between steps.

The KV cache is a component (``cache_policy.CachePolicy``; ``slot_policy.py``: a contiguous slot per
sequence, ``paged_policy.py``: blocks with shared prefixes and preemption), chosen by the caller
(``Engine(model, cache="paged")``); this module is the one loop over it.

Shapes: N rows ("slots"), A running sequences (rows 0..A-1), B decode rows (A, or A rounded up to a
bucket), R prefill rows (one per admitted request), T padded prompt length, V vocabulary.

One ``step()``:
  1. admit waiting requests (the policy allocates their cache); prefill each admitted prompt once (R
     rows, right-padded), let the policy give its other samples the prompt's keys (a copy, or shared
     blocks), and sample each sample's first token;
  2. make room for the next token (the policy; when it is short, sync, then preempt) and decode one
     token for every running sequence (fixed-shape [B, 1] forward over the cache). The decode is one
     forward that samples one token per row (``_decode_forward_no_sync``), then the host-side state
     advances (``_decode``): a drafted-and-verified step (speculative decoding) replaces the first and
     records several tokens per row in the second;
  3. every ``sync_every`` steps (or when a sequence reaches ``max_new_tokens``), copy the sampled tokens
     to the host in one transfer, finish sequences at their first stop token or at their length limit,
     free their cache and compact the running rows.
Between syncs the decode loop never waits for the device: tokens, log-probs, positions and the next
inputs stay in device tensors, and the sampler's noise is counter-based (see ``sampler.py``).

Overlapped sync (``overlap_sync``, on by default on CUDA): a due sync that no length limit forces starts
the copy of the tokens without waiting for it, and the step after enqueues its decode before it waits
for that copy and reads the tokens, so the device decodes while the host finishes sequences and frees
their slots (vLLM's and SGLang's overlap scheduling). A row that finished in the copied tokens has
decoded one more step, whose token is discarded (as tokens after a stop token before a sync are), and
it is freed, its completion returned and a waiting request admitted in its place one ``step()`` later
than without the overlap: whatever a caller does between steps (``update_weights``, ``cancel_all``,
``recompute_running``) meets the engine one step behind, so with requests waiting their admission, and
the versions of their tokens, can shift by a step. That extra row changes the step's batch, so reductions may round differently: in float32 the tests find the
same tokens and log-probs within 1e-6 of the sync in place; in bfloat16 a near-tie may sample another
token, as any other change of batch composition can.

Policy versions: a token's version is the engine's ``version`` when its logits were computed. After
``update_weights`` a running sequence continues with the new weights over its cached keys/values
(computed by the old ones), so one completion can carry several versions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from moerl.models.fp8 import FP8_DTYPE, copy_into_fp8
from moerl.rollout.cache_policy import CachePolicy, CacheSpec, PrefillRow
from moerl.rollout.cuda_graphs import GraphRunner, graph_batch_buckets, round_read_len
from moerl.rollout.host_sync import HostSync
from moerl.rollout.kv_cache import KVLayout, kv_layout
from moerl.rollout.paged_policy import PagedCachePolicy
from moerl.rollout.params import FINISH_ERROR, Completion, InvalidRequestError, Request, validate_request
from moerl.rollout.sampler import SamplingRows, sample_key, sample_no_sync
from moerl.rollout.scheduler import Admission, Scheduler, Sequence
from moerl.rollout.slot_policy import SlotCachePolicy
from moerl.rollout.spec_decode import SpeculativeDecoding
from moerl.rollout.stats import EngineStats

if TYPE_CHECKING:  # the config sits above the rollout engine (docs/architecture.md, Layers)
    from moerl.config import RolloutConfig


GPU_SYNC_EVERY = 8
"""Decode steps between host copies of the sampled tokens on CUDA when none is configured: the device runs
ahead of the host (with the overlapped sync it never waits for it); a finished sequence costs at most 7
discarded steps. The uniform and long-tail GPU benchmarks (bench/rollout_gpu.py, bench/paged_kv.py) run 8."""


def default_sync_every(device: torch.device) -> int:
    """``sync_every`` when none is given: ``GPU_SYNC_EVERY`` on CUDA, 1 elsewhere (a CPU runs the host's
    own work in between, so a later copy only wastes steps)."""
    return GPU_SYNC_EVERY if device.type == "cuda" else 1


CACHE_POLICIES: dict[str, Callable[[CacheSpec], CachePolicy]] = {
    "paged": PagedCachePolicy,
    "slots": SlotCachePolicy,
}
"""The engine's KV-cache policies by name (``Engine(cache=...)``; ``rollout.kv_cache`` names one):
``paged`` (blocks, shared prefixes, preemption; the run default) and ``slots`` (contiguous per-slot)."""


class Engine:
    """Batched generation for a ``moerl.models`` causal LM (any model with the KV cache seam), over a
    KV-cache policy component (``cache``: slots or paged blocks; ``cache_policy.CachePolicy``).

    Args:
        model: callable ``model(input_ids, attention_mask, position_ids, *, cache, return_routed_experts)``
            returning an object with ``logits`` [B, T, V] (and ``routed_experts`` [B, T, Lm, K] when
            asked), and a ``config`` with Hugging Face field names. Run as given (its train/eval mode is
            left alone) under ``torch.no_grad``.
        cache: the KV-cache policy: a name of ``CACHE_POLICIES`` (``"slots"``: a contiguous slot per
            sequence, ``slot_policy.py``; ``"paged"``: blocks with shared prefixes and preemption,
            ``paged_policy.py``) or a factory ``CacheSpec -> CachePolicy`` (a policy class).
        max_slots: most concurrent sequences.
        kv_token_budget: KV cache capacity in tokens over all sequences.
        max_seq_len: slots only: tokens per slot (prompt + new); ``None``: ``kv_token_budget // max_slots``.
            Capped at the model's ``max_position_embeddings``. The slot engine gets
            ``min(max_slots, budget // max_seq_len)`` slots. A paged sequence may use the whole cache.
        block_size: paged only: tokens per cache block (``None``: ``paged_policy.DEFAULT_BLOCK_SIZE``, 16).
        max_prefill_tokens: prompt tokens prefilled per step (at least one prompt is always admitted).
        max_stop_tokens: most stop token ids per request.
        sync_every: decode steps between host copies of the sampled tokens; larger values keep the device
            busy, at the cost of up to ``sync_every - 1`` wasted steps per finished sequence. ``None``: the
            device's default, ``default_sync_every`` (8 on CUDA, 1 elsewhere).
        batch_buckets: decode batch sizes to round B up to (fixed shapes for CUDA graphs); ``None``: with
            CUDA graphs ``cuda_graphs.graph_batch_buckets(slots)`` (at most 1.5x padding), else exact.
        attn_len_multiple: the decode read length R is rounded up to a multiple of this (in whole blocks
            when paged; with CUDA graphs also to four keys per doubling, ``cuda_graphs.round_read_len``:
            at most 25% over).
        seed: seeds the draw of a noise seed for requests whose ``params.seed`` is None.
        version: initial policy version.
        kv_layout_override: the KV geometry, when it cannot be derived from ``model.config``.
        cuda_graphs: on CUDA, replay decode steps from CUDA graphs captured once per (B, R, sampling
            flags) key (``moerl.rollout.cuda_graphs``; with ``batch_buckets`` few keys recur); False runs
            every step eagerly (steps that record routed experts, R3, are captured too).
        mla_cache: how a multi-head latent attention model is cached (``kv_cache.MLA_CACHE_FORMS``):
            ``latent`` (``kv_lora_rank + qk_rope_head_dim`` values per token and layer, absorbed decode)
            or ``expanded`` (per-head keys and values); other models ignore it.
        overlap_sync: overlap each host sync with the next decode step: the copy of the sampled tokens
            starts, the next step's decode is enqueued, then the host reads them (module docstring:
            finished sequences are freed and returned one ``step()`` later and decode one more
            discarded token); ``None``: on where the device runs asynchronously (CUDA), off on CPU
            (nothing to overlap); ``RolloutConfig.overlap_sync``.

    Raises:
        ValueError: an unknown ``cache`` name; sizes that leave no room for a sequence of two tokens; a
            non-positive sync/prefill/length/block setting; a setting of the other cache kind
            (``max_seq_len`` paged, ``block_size`` slots); an unknown ``mla_cache``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cache: str | Callable[[CacheSpec], CachePolicy] = "slots",
        max_slots: int = 64,
        kv_token_budget: int = 16384,
        max_seq_len: int | None = None,
        block_size: int | None = None,
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
        param = next(model.parameters())
        if sync_every is None:
            sync_every = default_sync_every(param.device)
        if sync_every < 1 or max_prefill_tokens < 1 or attn_len_multiple < 1:
            raise ValueError(
                f"sync_every={sync_every}, max_prefill_tokens={max_prefill_tokens}, "
                f"attn_len_multiple={attn_len_multiple} must all be >= 1"
            )
        spec = CacheSpec(
            layout=kv_layout_override or kv_layout(cfg, mla_cache),
            dtype=param.dtype,
            device=param.device,
            context=cfg.max_position_embeddings,
            num_attention_heads=cfg.num_attention_heads,
            max_slots=max_slots,
            kv_token_budget=kv_token_budget,
            max_prefill_tokens=max_prefill_tokens,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )
        self.policy: CachePolicy = cache_policy_factory(cache)(spec)
        """The KV-cache component: admission, allocation, freeing, eviction, the model's cache seam."""
        self.model = model
        self.device = param.device
        self.vocab_size: int = cfg.vocab_size
        self.max_seq_len = self.policy.max_seq_len
        """Longest sequence (prompt + new tokens) a request may ask for."""
        self.max_stop_tokens = max_stop_tokens
        self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else None
        self.attn_len_multiple = attn_len_multiple
        self.version = version
        """Policy version of the current weights (set by ``update_weights``)."""
        self._init_state(self.policy.num_slots, seed, sync_every, cuda_graphs, overlap_sync)

    def _init_state(
        self, num_slots: int, seed: int, sync_every: int, cuda_graphs: bool, overlap_sync: bool | None
    ) -> None:
        """Per-engine run state: sampling seeds, pending device results, per-slot tensors, counters and
        (on CUDA) the graph runner of decode steps."""
        self._seed_rng = random.Random(seed)
        overlap = self.device.type == "cuda" if overlap_sync is None else bool(overlap_sync)
        self.host = HostSync(sync_every, overlap)
        """Tokens sampled on the device and not yet read by the host, and their copy (``host_sync.py``)."""
        self.host.on_read = self._host_read
        self.speculation: SpeculativeDecoding | None = None
        """Speculative decoding (``moerl.rollout.spec_decode``; ``rollout.speculative``): a component that
        replaces a step's decode with a drafted-and-verified one when it says so; None = off. Needs a
        policy with ``room_for_drafts`` (the paged one)."""
        self._init_slot_state(num_slots)
        self._decode_steps = self._decode_rows = 0
        # Decode steps replayed from CUDA graphs, one per (B, R, sampling flags) key (cuda_graphs.py).
        self._graphs = GraphRunner(self.device) if cuda_graphs and self.device.type == "cuda" else None
        if self._graphs is not None and self.batch_buckets is None:  # keys that recur (cuda_graphs.py)
            self.batch_buckets = graph_batch_buckets(num_slots)

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        cfg: RolloutConfig,
        *,
        cache: str | Callable[[CacheSpec], CachePolicy] = "slots",
        seed: int = 0,
        version: int = 0,
    ) -> Engine:
        """An engine sized by the run config's ``RolloutConfig`` (slots, KV budget, prefill cap, sync
        period, and ``kv_block_size`` for a paged ``cache``) over the cache policy the caller chose
        (``moerl.runtime.build.make_engine`` passes ``rollout.kv_cache``; this never reads it)."""
        kind = cache_policy_factory(cache)
        if cfg.speculative != "off" and not hasattr(kind, "room_for_drafts"):
            raise ValueError(
                f"rollout.speculative={cfg.speculative} needs a cache policy that reserves drafted "
                f"positions (room_for_drafts: the paged one); got {getattr(kind, 'kind', kind)!r}"
            )
        engine = cls(
            model,
            cache=kind,
            max_slots=cfg.max_slots,
            kv_token_budget=cfg.kv_token_budget,
            block_size=cfg.kv_block_size if getattr(kind, "kind", None) == "paged" else None,
            max_prefill_tokens=cfg.max_prefill_tokens,
            sync_every=cfg.sync_every,
            seed=seed,
            version=version,
            mla_cache=cfg.mla_cache,
            overlap_sync=None if cfg.overlap_sync else False,
        )
        engine.speculation = SpeculativeDecoding.from_config(model, cfg)  # rollout.speculative (or None)
        return engine

    def _init_slot_state(self, n: int) -> None:
        dev = self.device
        # prompt + generated tokens; free slots hold 1 so that padded decode rows stay in range
        self._seq_len = torch.ones(n, dtype=torch.int64, device=dev)
        self._last_token = torch.zeros(n, dtype=torch.int64, device=dev)  # next decode input
        self._active = torch.zeros(n, dtype=torch.int64, device=dev)  # 1 for running slots
        self._temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(n, dtype=torch.int64, device=dev)
        self._top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self._keys = torch.zeros(n, dtype=torch.int64, device=dev)
        self._slot_state = [
            self._seq_len,
            self._last_token,
            self._active,
            self._temperature,
            self._top_k,
            self._top_p,
            self._keys,
            *self.policy.row_state,  # e.g. the paged block table: moved with its row on compaction
        ]

    @property
    def sync_every(self) -> int:
        """Steps between host copies of the sampled tokens (``HostSync.sync_every``)."""
        return self.host.sync_every

    @property
    def cache_kind(self) -> str:
        """The cache policy's name (``"slots"``, ``"paged"``)."""
        return self.policy.kind

    @property
    def cache(self):
        """The model's KV-cache seam object of the policy (``SlotKVCache``, ``PagedKVCache``)."""
        return self.policy.kv

    @property
    def scheduler(self) -> Scheduler:
        """The policy's host scheduler (waiting requests, running rows)."""
        return self.policy.scheduler

    @property
    def num_slots(self) -> int:
        """N, most sequences running together (rows of the per-row state)."""
        return self.policy.num_slots

    @property
    def num_unfinished(self) -> int:
        """Samples waiting or running."""
        return self.scheduler.num_unfinished

    def running_by_request(self) -> dict[str, list[Sequence]]:
        """The running samples of each request id (``Scheduler.running_by_request``; thread-safe copy)."""
        return self.scheduler.running_by_request()

    def add_request(self, request: Request) -> None:
        """Validate and queue a request; its completions come out of later ``step()`` calls.

        Raises:
            InvalidRequestError: the request can never run (bad parameters, empty prompt, token ids
                outside the vocabulary, prompt + max_new_tokens longer than a slot, duplicate id in
                flight). Nothing is queued; other requests are unaffected.
        """
        validate_request(
            request,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            max_stop_tokens=self.max_stop_tokens,
        )
        if self.scheduler.is_in_flight(request.request_id):
            raise InvalidRequestError(request.request_id, "a request with this id is already in flight")
        seed = request.params.seed
        if seed is None:
            seed = self._seed_rng.getrandbits(63)
        self.scheduler.add(request, seed)

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """Admit and prefill, decode one token for every running sequence, and sync when due.

        Returns:
            The completions that finished in this step (in no particular order).
        """
        done: list[Completion] = []
        admissions = self._admit()
        if admissions:
            self._prefill(admissions)
            self.host.steps += 1
        if self._sync_due() and (self.host.staged is None or self._at_limit()):
            done += self._sync()
        done += self._reserve_decode()
        if (
            self.scheduler.running
            and self.speculation is not None
            and self.speculation.should_speculate(self)
        ):
            done += self.speculation.step(self)  # draft, verify, accept, sync (moerl.rollout.spec_decode)
        elif self.scheduler.running:
            done += self._plain_step()
        if self.host.staged is not None:  # the copy started last step: read now, this step's decode runs
            done += self._finished(self.host.read_staged())
        if self._sync_due():
            if self.host.overlap and self.scheduler.running and not self._at_limit():
                self.host.stage()
            else:
                done += self._sync()
        return done

    def generate(self, requests: Iterable[Request], *, on_error: str = "raise") -> list[Completion]:
        """Run requests to completion (blocking); completions in request order, then sample index.

        Args:
            requests: the requests; ids must be unique.
            on_error: ``"raise"``: validate every request first and raise on the first invalid one
                before generating anything; ``"return"``: generate the valid ones and return one
                ``finish_reason="error"`` completion (with ``error`` set) per invalid request.
        Raises:
            InvalidRequestError: an invalid request (``on_error="raise"``).
            RuntimeError: the engine already has requests in flight from ``add_request``.
        """
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error={on_error!r}; choose 'raise' or 'return'")
        if self.num_unfinished:
            raise RuntimeError("generate() needs an idle engine; drain add_request() work with step() first")
        requests = list(requests)
        errors: dict[int, str] = {}
        for i, req in enumerate(requests):
            try:
                self.add_request(req)
            except InvalidRequestError as e:
                if on_error == "raise":
                    self._drop_waiting()
                    raise
                errors[i] = str(e)
        by_key: dict[tuple[str, int], Completion] = {}
        while self.num_unfinished:
            for c in self.step():
                by_key[(c.request_id, c.sample_index)] = c
        out = []
        for i, req in enumerate(requests):
            if i in errors:
                out.append(
                    Completion(
                        request_id=req.request_id,
                        sample_index=0,
                        prompt_ids=list(req.prompt_ids),
                        token_ids=[],
                        logprobs=[],
                        finish_reason=FINISH_ERROR,
                        policy_versions=[],
                        error=errors[i],
                    )
                )
            else:
                out += [by_key[(req.request_id, j)] for j in range(req.params.n)]
        return out

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy new weights into the model in place (between steps); the KV cache is kept.

        Args:
            named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs with names of
                ``model.named_parameters()`` / ``named_buffers()``; a subset updates only those tensors.
                Tensors are cast to the parameter's dtype and device; into an FP8 weight
                (``rollout.weight_dtype=fp8``) a full-precision tensor is block-quantized, its
                ``_scale_inv`` scales set with it (``moerl.models.fp8.copy_into_fp8``).
            version: the new policy version; tokens sampled from now on carry it.
        Raises:
            KeyError: an unknown tensor name. ValueError: a shape mismatch. Nothing is copied then.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        targets = dict(self.model.named_parameters())
        targets.update(self.model.named_buffers())
        for name, t in items:
            if name not in targets:
                raise KeyError(
                    f"update_weights: unknown tensor {name!r} (not a parameter or buffer of the model)"
                )
            if tuple(t.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(t.shape)}; the model's is "
                    f"{tuple(targets[name].shape)}"
                )
        for name, t in items:
            if targets[name].dtype == FP8_DTYPE:  # rollout.weight_dtype=fp8: quantized here, on load
                copy_into_fp8(targets, name, t)
            else:
                targets[name].copy_(t)
        self.version = int(version)
        self.policy.weights_changed()

    @property
    def stats(self) -> EngineStats:
        """Cache use and counters of this engine since it started (``moerl.rollout.stats``): blocks
        (slots for the slot policy), preemptions, prefill vs prefix-hit tokens, decode batch sizes."""
        sched = self.scheduler
        kv_tokens, blocks_total, blocks_used = self.policy.capacity()
        return EngineStats(
            kv_tokens=kv_tokens,
            kv_tokens_used=sum(s.seq_len for s in sched.running),
            blocks_total=blocks_total,
            blocks_used=blocks_used,
            running=len(sched.running),
            prefill_tokens=sched.prefill_tokens,
            decode_steps=self._decode_steps,
            decode_rows=self._decode_rows,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            preemptions=sched.num_preemptions,
            **(self.speculation.stats() if self.speculation is not None else {}),
        )

    # -- Admission, prefill and decode ----------------------------------------------------------

    def _admit(self) -> list[Admission]:
        """This step's admissions (the policy's scheduler's plan, cache allocated)."""
        return self.scheduler.admit(sample_key)

    def _reserve_decode(self) -> list[Completion]:
        """Make room for the next decode step: the policy gives each running sequence room for its next
        token; while it is short, pending tokens are synced first (which may finish sequences and free
        theirs), then it evicts (preempts) sequences. Returns completions finished by those syncs.

        Raises:
            RuntimeError: still short with one sequence running (a request longer than the cache).
        """
        done: list[Completion] = []
        policy, sched = self.policy, self.scheduler
        while sched.running and policy.blocks_short() > 0:
            if self.host:
                done += self._sync()
                continue
            victims = policy.preempt(policy.blocks_short())
            self._vacate(victims, sched.remove(victims))
            if policy.blocks_short() > 0:
                raise RuntimeError(
                    f"{policy.kind} KV cache: {policy.blocks_short()} blocks short with one sequence "
                    "running; a request longer than the cache was admitted"
                )
        policy.prepare_decode(self._bucket(len(sched.running)) if sched.running else 0)
        return done

    def _forward_prefill(
        self, rows: list[PrefillRow], want_routed: bool, *, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prefill forward of ``rows`` into the cache (the policy binds it); returns the logits
        [R, T, V], row r's last computed position at ``len(tokens) - start - 1``, and with
        ``want_hidden`` the final hidden states [R, T, H] (else None; the MTP drafter's input)."""
        ids, pos = self.policy.bind_prefill(rows)
        more = {"return_hidden": True} if want_hidden else {}  # only MoeForCausalLM knows it
        out = self.model(
            ids.to(self.device), None, pos, cache=self.cache, return_routed_experts=want_routed, **more
        )
        if want_routed:
            self.policy.record_routed(out.routed_experts)  # [R, T, Lm, K]
        self.policy.unbind()
        return out.logits, getattr(out, "hidden", None)

    def _prefill(self, admissions: list[Admission]) -> None:
        """Prefill each admission once (its first sample's cache), let the policy place the group's other
        samples, and sample each new sample's first token from the prompt's last logits (a readmitted
        sequence continues from its last token)."""
        want_routed = any(a.request.params.return_routed_experts for a in admissions)
        rows = [PrefillRow(a.sequences[0], a.tokens, a.cached) for a in admissions]
        spec = self.speculation
        logits, hidden = self._forward_prefill(
            rows, want_routed, want_hidden=spec is not None and spec.wants_hidden
        )
        self.policy.place_prefill(admissions)
        self._first_tokens(admissions, logits)
        if spec is not None:
            spec.policy.note_other()  # a prefill since the last sync: that run of steps is not timed
        if hidden is not None:  # the MTP drafter's first draft conditions on the prompt's hidden states
            spec.keep_prefill(self, admissions, hidden)

    def _first_tokens(self, admissions: list[Admission], logits: torch.Tensor) -> None:
        """The admitted rows' device state; each new sample's first token sampled from the prompt's last
        logits (a readmitted sequence continues from its last token)."""
        dev = self.device
        all_seqs = [s for a in admissions for s in a.sequences]
        slot_all = torch.tensor([s.slot for s in all_seqs], dtype=torch.int64, device=dev)
        self._set_slot_params(all_seqs, slot_all)
        self._active[slot_all] = 1
        resumed = [a.sequences[0] for a in admissions if a.resumed]
        if resumed:  # the last token is the next decode input
            idx = torch.tensor([s.slot for s in resumed], dtype=torch.int64, device=dev)
            self._last_token[idx] = torch.tensor(
                [s.token_ids[-1] for s in resumed], dtype=torch.int64, device=dev
            )
            self._seq_len[idx] = torch.tensor([s.seq_len for s in resumed], dtype=torch.int64, device=dev)
        fresh = [(r, a) for r, a in enumerate(admissions) if not a.resumed]
        if not fresh:
            return
        n_new = torch.tensor([len(a.tokens) - a.cached for a in admissions], device=dev)
        last = logits[torch.arange(len(admissions), device=dev), n_new - 1]  # [R, V]
        seqs: list[Sequence] = []
        rows_of: list[int] = []
        for r, a in fresh:
            seqs += a.sequences
            rows_of += [r] * len(a.sequences)
        slot_idx = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev)
        prompt_len = torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64, device=dev)
        tokens, logprobs = sample_no_sync(
            last[torch.tensor(rows_of, device=dev)], self._rows(slot_idx, seqs), prompt_len
        )  # the first new token sits at position P
        self._last_token[slot_idx] = tokens
        self._seq_len[slot_idx] = prompt_len + 1
        self._record(seqs, tokens, logprobs)

    def _set_slot_params(self, seqs: list[Sequence], slot_idx: torch.Tensor) -> None:
        dev = self.device
        ps = [s.request.params for s in seqs]
        self._temperature[slot_idx] = torch.tensor(
            [p.temperature for p in ps], dtype=torch.float32, device=dev
        )
        self._top_k[slot_idx] = torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev)
        self._top_p[slot_idx] = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        self._keys[slot_idx] = torch.tensor([s.noise_key for s in seqs], dtype=torch.int64, device=dev)

    def _rows(self, idx: torch.Tensor | slice, seqs: list[Sequence]) -> SamplingRows:
        ps = [s.request.params for s in seqs]
        return SamplingRows(
            temperature=self._temperature[idx],
            top_k=self._top_k[idx],
            top_p=self._top_p[idx],
            keys=self._keys[idx],
            all_greedy=all(p.is_greedy for p in ps),
            any_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in ps),
        )

    def _decode(self) -> None:
        """One decode step of every running row: the step's shape (B rows, the policy's read length: its
        CUDA-graph key), the forward that samples one token per row (``_decode_forward_no_sync``,
        replayed from a graph on CUDA), then the per-row state advanced outside the graph.

        A speculative step (``moerl.rollout.spec_decode``) replaces this with the same shape of work:
        a graph-replayed forward of k + 1 decode rows per sequence (``spec_decode.verify_forward_no_sync``) that
        drafts, verifies and accepts, then the rows' state advanced outside the graph.
        """
        seqs = self.scheduler.running
        a = len(seqs)
        b = self._bucket(a)
        read_len = self._read_len(seqs)
        want_routed = any(s.request.params.return_routed_experts for s in seqs)  # R3: graph-safe once
        rows = self._rows(slice(0, b), seqs)  # a prefill allocated the static buffer (in place, no sync)
        if self._graphs is not None and (not want_routed or self.cache.routed is not None):
            key = (
                b,
                read_len,
                rows.all_greedy,
                rows.any_truncation,
                want_routed,
                self._keeps_hidden(),
                *self._decode_variant(),
            )
            tokens, logprobs = self._graphs.run(
                key, lambda: self._decode_forward_no_sync(b, read_len, rows, want_routed)
            )
        else:
            tokens, logprobs = self._decode_forward_no_sync(b, read_len, rows, want_routed)
        # Advanced outside the graph: a capture's warm-up run executes the step once more.
        self._last_token[:b] = tokens
        self._seq_len[:b] += self._active[:b]
        self._record(seqs, tokens[:a], logprobs[:a])
        self._decode_steps += 1
        self._decode_rows += a

    def _plain_step(self) -> list[Completion]:
        """One plain decode step (``_decode``), from exact lengths: pending speculative steps are read
        first (``_read_exact``). Returns the completions that read finished."""
        done = self._read_exact() if self.speculation is not None and self.host.has_several else []
        if self.scheduler.running:
            self._decode()
            self.host.steps += 1
            if self.speculation is not None:
                self.speculation.policy.note_plain(1)
        return done

    def _read_exact(self) -> list[Completion]:
        """Read every pending token (finishing sequences), then give the running ones room for their next
        token again (``_reserve_decode``): afterwards every length is known exactly."""
        return self._sync_all() + self._reserve_decode()

    def _host_read(self) -> None:
        """The host read sampled tokens (``HostSync.on_read``): speculation measures its cost there."""
        if self.speculation is not None:
            self.speculation.policy.at_sync()

    def _decode_variant(self) -> tuple:
        """What else decides the decode step's Python path (part of its CUDA-graph key): the policy's."""
        return self.policy.decode_variant()

    def _read_len(self, seqs: list[Sequence], extra: int = 0) -> int:
        """The decode's read length per row (keys for slots, blocks for paged; ``CachePolicy.read_len``);
        ``extra``: positions fed past each row's next one (a speculative verify's drafts; paged only)."""
        if extra:
            return self.policy.read_len(seqs, self.attn_len_multiple, self._round_read_len, extra)
        return self.policy.read_len(seqs, self.attn_len_multiple, self._round_read_len)

    def _round_read_len(self, need: int, multiple: int, cap: int) -> int:
        """``need`` (tokens, or blocks when paged) rounded up to a multiple of ``multiple``, capped at
        ``cap``; with CUDA graphs also to four keys per doubling (``cuda_graphs.round_read_len``)."""
        if self._graphs is not None:
            return round_read_len(need, multiple, cap)
        return min(cap, -(-need // multiple) * multiple)

    def _decode_forward_no_sync(
        self, b: int, read_len: int, rows: SamplingRows, want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode forward of slots 0..b-1: feed each slot's last token, sample the next one.

        Reads the engine's preallocated device state (last tokens, lengths, KV cache, sampling
        parameters) and writes only the KV cache (the same keys/values at the same positions if run
        twice); its Python path depends only on (b, read_len, the rows' flags, want_routed), and it never
        waits for the device: the unit a CUDA graph captures per key (the caller advances the state).

        Returns:
            tokens [b] int64, logprobs [b] float32.
        """
        seq_len = self._seq_len[:b]
        pos = seq_len - 1  # the last sampled token is fed at its own position
        self.policy.bind_decode(b, pos, read_len)
        spec = self.speculation if self._keeps_hidden() else None
        more = {"return_hidden": True} if spec is not None else {}  # only MoeForCausalLM knows it
        out = self.model(
            self._last_token[:b, None],
            None,
            pos[:, None],
            cache=self.cache,
            return_routed_experts=want_routed,
            **more,
        )
        if want_routed:
            self.policy.record_routed(out.routed_experts)  # [B, 1, Lm, K]
        self.policy.unbind()
        tokens, logprobs = sample_no_sync(out.logits[:, -1], rows, seq_len)
        if spec is not None:  # the MTP drafter's ring: every fed position's hidden state, and its token
            spec.keep_decode_no_sync(b, pos, out.hidden[:, -1], tokens)
        return tokens, logprobs

    def _keeps_hidden(self) -> bool:
        """Whether decode steps hand their hidden states to the speculation's drafter (the MTP ring)."""
        spec = self.speculation
        return spec is not None and spec.wants_hidden and bool(spec.row_state)

    def _bucket(self, a: int) -> int:
        if self.batch_buckets is None:
            return a
        return min([x for x in self.batch_buckets if a <= x <= self.num_slots] or [self.num_slots])

    def _record(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """One step's sampled tokens of ``seqs`` (on the device), sampled by the current weights."""
        self.host.record(seqs, tokens, logprobs, self.version)

    # -- Host sync: finishing and compaction ---------------------------------------------------

    def _sync_due(self) -> bool:
        return self.host.due(self._at_limit)

    def _at_limit(self) -> bool:
        """Some running sequence has all its ``max_new_tokens`` by the host's count (it must not decode
        again; a speculative step's tokens not read yet are limited on the device instead)."""
        return any(s.num_generated >= s.request.params.max_new_tokens for s in self.scheduler.running)

    def _sync_all(self) -> list[Completion]:
        """Finish a started copy and sync every pending token: afterwards the host knows every token."""
        return self._finished(self.host.read_everything())

    def _sync(self) -> list[Completion]:
        """Copy every pending token to the host (waiting for the device), then finish and release the
        sequences that finished (a started copy is covered by this one)."""
        return self._finished(self.host.read_all())

    def _finished(self, finished: list[Sequence]) -> list[Completion]:
        """The completions of ``finished`` sequences (read by the host sync), their cache and rows freed."""
        completions = [self._completion(s) for s in finished]
        self._release(finished)
        return completions

    def _completion(self, seq: Sequence) -> Completion:
        routed = None
        if seq.request.params.return_routed_experts and self.cache.routed is not None:
            n = seq.prompt_len + len(seq.token_ids) - 1
            routed = self.policy.routed_records(seq, n).to("cpu", torch.int64)
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
        """Free what finished sequences hold (cache, then rows) and compact the running rows."""
        self.policy.release(finished)
        if not finished:
            return
        self._vacate(finished, self.scheduler.release(finished))

    def _vacate(self, seqs: list[Sequence], moves: list[tuple[int, int]]) -> None:
        """Apply to the device state the removal of ``seqs`` from their slots and the scheduler's
        compaction ``moves`` (``Scheduler.remove``)."""
        self._reset_slots(torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=self.device))
        if not moves:
            return
        # One batched copy for all moves: sources (>= the running count) and destinations (< it) are
        # disjoint.
        src, dst = [m[0] for m in moves], [m[1] for m in moves]
        self.policy.move_rows(src, dst)
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for state in self._slot_state + (self.speculation.row_state if self.speculation else []):
            state[dst_t] = state[src_t]
        self._reset_slots(src_t)

    def _reset_slots(self, idx: torch.Tensor) -> None:
        """Mark slots free: inactive, length 1 (a padded decode row stays in range)."""
        self._active[idx] = 0
        self._seq_len[idx] = 1
        self.policy.reset_rows(idx)

    def _reprefill(self, seqs: list[Sequence]) -> None:
        """One prefill forward of the prefixes of ``seqs`` (prompt and generated tokens but the last: the
        last is the next decode input) into their own cache; logits are discarded
        (``weight_update.reprefill``)."""
        want_routed = any(s.request.params.return_routed_experts for s in seqs)
        rows = [PrefillRow(s, list(s.request.prompt_ids) + s.token_ids[:-1]) for s in seqs]
        self._forward_prefill(rows, want_routed)

    def _drop_waiting(self) -> None:
        """Forget queued (and preempted) requests: ``generate`` rejecting a batch, ``cancel_all``."""
        self.scheduler.drop_all()


def cache_policy_factory(
    cache: str | Callable[[CacheSpec], CachePolicy],
) -> Callable[[CacheSpec], CachePolicy]:
    """The policy factory ``cache`` names (``CACHE_POLICIES``), or ``cache`` itself when it is one.

    Raises:
        ValueError: an unknown name. TypeError: neither a name nor a callable.
    """
    if isinstance(cache, str):
        if cache not in CACHE_POLICIES:
            raise ValueError(
                f"cache={cache!r}: expected one of {sorted(CACHE_POLICIES)} or a CachePolicy class"
            )
        return CACHE_POLICIES[cache]
    if not callable(cache):
        raise TypeError(
            f"cache={cache!r}: expected a name of {sorted(CACHE_POLICIES)} or a CachePolicy class"
        )
    return cache
