"""Rollout: the inference engine (scheduler, KV cache, sampler) that generates RL samples.

Public API (docs/architecture.md, "Rollout engine"):
    SamplingParams(temperature, top_p, top_k, max_new_tokens, stop_token_ids, n, seed, return_routed_experts)
    Request(request_id, prompt_ids, params)
    Engine(model, *, max_slots, kv_token_budget, ...): generate(requests) -> list[Completion],
        add_request(request), step() -> list[Completion], update_weights(named_tensors, version), version,
        stats -> EngineStats (a static per-slot KV cache)
    PagedEngine(model, *, max_slots, kv_token_budget, block_size, ...): the same seam over a paged KV
        cache (shared prefixes, preemption); what runs build (``rollout.kv_cache: paged``)
    Completion(request_id, sample_index, prompt_ids, token_ids, logprobs, finish_reason, policy_versions,
        routed_experts)
    token_logprobs(logits, tokens, temperature): the behaviour log-prob convention the trainer shares.
"""

from moerl.rollout.engine import Engine
from moerl.rollout.paged_engine import PagedEngine
from moerl.rollout.params import Completion, InvalidRequestError, Request, SamplingParams
from moerl.rollout.sampler import token_logprobs

__all__ = [
    "Completion",
    "Engine",
    "InvalidRequestError",
    "PagedEngine",
    "Request",
    "SamplingParams",
    "token_logprobs",
]
