"""Rollout: the inference engine (scheduler, KV cache, sampler) that generates RL samples.

Public API (docs/architecture.md, "Rollout engine"):
    SamplingParams(temperature, top_p, top_k, max_new_tokens, stop_token_ids, n, seed, return_routed_experts)
    Request(request_id, prompt_ids, params)
    Engine(model, *, cache="slots"|"paged"|CachePolicy class, max_slots, kv_token_budget, ...):
        generate(requests) -> list[Completion], add_request(request), step() -> list[Completion],
        update_weights(named_tensors, version), version, stats -> EngineStats; its KV cache is a
        component (``cache_policy.CachePolicy``): contiguous slots, or paged blocks with shared
        prefixes and preemption (what runs build, ``rollout.kv_cache: paged``)
    Engine.from_config(model, rollout_cfg, *, cache, seed, version): sized by a ``RolloutConfig``
    Completion(request_id, sample_index, prompt_ids, token_ids, logprobs, finish_reason, policy_versions,
        routed_experts)
    token_logprobs(logits, tokens, temperature): the behaviour log-prob convention the trainer shares.
"""

from moerl.rollout.cache_policy import CachePolicy, CacheSpec
from moerl.rollout.engine import CACHE_POLICIES, Engine
from moerl.rollout.params import Completion, InvalidRequestError, Request, SamplingParams
from moerl.rollout.sampler import token_logprobs

__all__ = [
    "CACHE_POLICIES",
    "CachePolicy",
    "CacheSpec",
    "Completion",
    "Engine",
    "InvalidRequestError",
    "Request",
    "SamplingParams",
    "token_logprobs",
]
