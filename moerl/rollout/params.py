"""The rollout engine's typed boundary: sampling parameters, requests, completions, request errors.

A ``Request`` asks for ``params.n`` samples of one prompt (a GRPO group); each sample comes back as
one ``Completion``. Validation that depends only on the parameters happens in ``SamplingParams``;
validation that needs the model and the cache (vocabulary, context length, slot capacity) happens in
``validate_request``, which the engine calls on admission.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the config sits above the rollout engine (docs/architecture.md, Layers)
    from moerl.config import RolloutConfig


FINISH_STOP = "stop"
"""The completion ended with one of its stop tokens (included in the output and its loss mask)."""
FINISH_LENGTH = "length"
"""The completion reached ``max_new_tokens``."""
FINISH_ERROR = "error"
"""The request was invalid (only with ``Engine.generate(..., on_error="return")``); no tokens."""


class InvalidRequestError(ValueError):
    """A request cannot be served; the message names the request id and what is wrong.

    Raised for that request only: the engine's other requests are unaffected.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample the completions of one request.

    Raises ``ValueError`` on construction when a field is out of range (``temperature < 0``, ``n < 1``,
    ``top_p`` outside (0, 1], ``top_k < 0``, ``max_new_tokens < 1``, a negative stop token id).
    """

    temperature: float = 1.0
    """Softmax temperature T; 0 means greedy (argmax of the raw logits)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p, in (0, 1]
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", sec. 3.1). Applied after top-k
    on the renormalized distribution, as transformers and vLLM do."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_new_tokens: int = 16
    """Most tokens to generate per sample (the stop token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after the first of these tokens, which is included in the output."""
    n: int = 1
    """Samples of the prompt (the GRPO group size); they share one prefill of the prompt."""
    seed: int | None = None
    """Seed of this request's sampling noise; equal seeds give equal samples whatever else is in the
    batch. ``None``: the engine draws one from its own seeded generator on admission."""
    return_routed_experts: bool = False
    """Return the routed experts of every token fed to the model (rollout routing replay, R3)."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be >= 0 (0 disables)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n!r} must be >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative token ids")

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        *,
        stop_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        n: int | None = None,
    ) -> SamplingParams:
        """The sampling of one group from the run config (``n`` defaults to ``cfg.group_size``)."""
        return cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=stop_token_ids,
            n=cfg.group_size if n is None else n,
            seed=seed,
            return_routed_experts=cfg.return_routed_experts,
        )

    @property
    def is_greedy(self) -> bool:
        """True when sampling is the argmax of the logits (temperature 0)."""
        return self.temperature == 0.0


@dataclass(kw_only=True, slots=True)
class Request:
    """One prompt to complete ``params.n`` times.

    ``params`` may be invalid on purpose (built with ``object.__new__`` or mutated); the engine
    re-validates every request on admission and raises ``InvalidRequestError`` for that request only.
    """

    request_id: str
    """Caller's id, unique among the engine's requests in flight."""
    prompt_ids: list[int]
    """Prompt token ids (non-empty, each in [0, vocab_size))."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """How to sample this request's completions."""


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sample of one request.

    ``logprobs[i]`` is log softmax(logits_i / T)[token_ids[i]] in float32, computed before top-k/top-p
    truncation (greedy requests use T = 1); the trainer's recomputation uses the same convention
    (``moerl.rollout.sampler.token_logprobs``).
    """

    request_id: str
    """The request's id."""
    sample_index: int
    """Which of the request's n samples, in [0, n)."""
    prompt_ids: list[int]
    """The prompt token ids, as given."""
    token_ids: list[int]
    """Generated ids; ends with the stop token when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token (float32 values as Python floats)."""
    finish_reason: str
    """``"stop"`` (a stop token was generated), ``"length"`` (max_new_tokens reached), or ``"error"``."""
    policy_versions: list[int]
    """Weight version that computed the logits of each generated token."""
    routed_experts: torch.Tensor | None = None
    """[P + G - 1, L_moe, k] int64: routed experts of every token fed to the model (the prompt and all
    generated tokens but the last, which is never fed); ``None`` unless requested."""
    error: str | None = None
    """Why the request was rejected (``finish_reason == "error"`` only)."""

    @property
    def loss_mask(self) -> list[int]:
        """1 for every generated token, the stop token included (tokens after it are never generated)."""
        return [1] * len(self.token_ids)


def validate_request(request: Request, *, vocab_size: int, max_seq_len: int, max_stop_tokens: int) -> None:
    """Check a request against the model and the cache; raise ``InvalidRequestError`` if it can never run.

    Args:
        request: the request to check.
        vocab_size: V; every prompt and stop token id must be in [0, V).
        max_seq_len: the longest sequence a slot holds (min of slot capacity and the model's context);
            prompt length + ``max_new_tokens`` must not exceed it.
        max_stop_tokens: most stop token ids per request that the engine's stop table holds.

    Raises:
        InvalidRequestError: naming the request id and the problem.
    """
    rid = request.request_id
    p = request.params
    if not isinstance(p, SamplingParams):
        raise InvalidRequestError(rid, f"params must be SamplingParams, got {type(p).__name__}")
    try:  # params may have been mutated after construction
        SamplingParams.__post_init__(p)
    except ValueError as e:
        raise InvalidRequestError(rid, str(e)) from None
    ids = request.prompt_ids
    if len(ids) == 0:
        raise InvalidRequestError(rid, "empty prompt (at least one token is needed)")
    try:
        ids = [operator.index(t) for t in ids]
    except TypeError:
        raise InvalidRequestError(rid, "prompt_ids must be integers") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            rid, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    bad_stop = [t for t in p.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidRequestError(
            rid, f"stop token ids {bad_stop} are outside the vocabulary [0, {vocab_size})"
        )
    if len(p.stop_token_ids) > max_stop_tokens:
        raise InvalidRequestError(rid, f"{len(p.stop_token_ids)} stop tokens; at most {max_stop_tokens}")
    if len(ids) >= max_seq_len:
        raise InvalidRequestError(
            rid, f"prompt of {len(ids)} tokens is longer than the context: it must be < {max_seq_len}"
        )
    if len(ids) + p.max_new_tokens > max_seq_len:
        raise InvalidRequestError(
            rid,
            f"prompt ({len(ids)}) + max_new_tokens ({p.max_new_tokens}) = {len(ids) + p.max_new_tokens} "
            f"tokens can never fit a cache slot of {max_seq_len} tokens",
        )
