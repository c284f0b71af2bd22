"""``build_model``: a model from the run config's ``ModelConfig`` (fresh, or loaded when ``path`` is set)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moerl.configlib import ConfigError
from moerl.models.checkpoint import from_pretrained
from moerl.models.config import MoeConfig
from moerl.models.dtypes import torch_dtype
from moerl.models.model import MoeForCausalLM

if TYPE_CHECKING:  # the config sits above the models (docs/architecture.md, Layers)
    from moerl.config import ModelConfig


BIAS_FAMILIES = ("deepseek_v3", "glm4_moe")
"""Model families whose routers carry ``e_score_correction_bias`` (aux-loss-free balancing); the config
checks ``trainer.bias_update_rate`` against this list."""


def arch_from_model_config(m: ModelConfig, vocab_size: int) -> MoeConfig:
    """The ``MoeConfig`` of a fresh model of family ``m.family`` with the sizes of ``m``.

    Family traits follow the released models: Qwen3-MoE (per-head q/k norm, normalized top-k),
    Qwen2-MoE (qkv bias, gated shared expert of width 2I), Mixtral (normalized top-k), OLMoE (full q/k
    norm), DeepSeek-V3 (MLA with nope/rope/v head dims hd, hd/2, hd, latent rank ``kv_lora_rank`` (default
    H/2) and query rank ``q_lora_rank``; sigmoid routing; one shared expert; layer 0 dense), GLM-4.5
    (sigmoid routing, one shared expert, half-rotary, layer 0 dense). ``first_dense_layers`` and
    ``dense_intermediate_size`` override the dense layers' count and width (default 2I).

    Raises:
        ConfigError: unknown family, or qwen2_moe with head_dim != hidden_size / num_heads.
    """
    base = dict(
        model_type=m.family,
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.dense_intermediate_size or 2 * m.moe_intermediate_size,
        moe_intermediate_size=m.moe_intermediate_size,
        num_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        use_score_correction_bias=m.family in BIAS_FAMILIES,
    )
    hd = m.head_dim
    dense0 = (1 if m.num_layers > 1 else 0) if m.first_dense_layers is None else m.first_dense_layers
    traits: dict[str, dict] = {
        "qwen3_moe": dict(qk_norm="head", norm_topk_prob=True),
        "qwen2_moe": dict(
            qkv_bias=True, shared_intermediate_size=2 * m.moe_intermediate_size, shared_expert_gate=True
        ),
        "mixtral": dict(norm_topk_prob=True),
        "olmoe": dict(qk_norm="full"),
        "deepseek_v3": dict(
            scoring_func="sigmoid",
            norm_topk_prob=True,
            shared_intermediate_size=m.moe_intermediate_size,
            first_k_dense_replace=dense0,
            kv_lora_rank=m.kv_lora_rank or max(1, m.hidden_size // 2),
            q_lora_rank=m.q_lora_rank,
            qk_nope_head_dim=hd,
            qk_rope_head_dim=max(2, hd // 2),
            v_head_dim=hd,
            head_dim=max(2, hd // 2),
            num_key_value_heads=m.num_heads,
            rope_interleave=True,
        ),
        "glm4_moe": dict(
            scoring_func="sigmoid",
            norm_topk_prob=True,
            shared_intermediate_size=m.moe_intermediate_size,
            first_k_dense_replace=dense0,
            partial_rotary_factor=0.5,
        ),
    }
    if m.family not in traits:
        raise ConfigError(f"model.family={m.family!r} is not allowed; choose one of {sorted(traits)}")
    if m.family == "qwen2_moe" and m.head_dim * m.num_heads != m.hidden_size:
        raise ConfigError(
            f"model.head_dim={m.head_dim} must equal hidden_size / num_heads = "
            f"{m.hidden_size // m.num_heads} for qwen2_moe"
        )
    return MoeConfig(**{**base, **traits[m.family]})


def build_model(model_cfg: ModelConfig, vocab_size: int) -> MoeForCausalLM:
    """The run's model: ``from_pretrained(model_cfg.path)`` when a path is set, else a fresh model.

    A fresh model draws Normal(0, 0.02) weights from the caller's torch RNG (seed it first).

    Args:
        model_cfg: the run config's model section (its dtype and device are applied).
        vocab_size: tokenizer vocabulary size V (ignored when loading: the checkpoint's config rules).
    Raises:
        ConfigError: see ``arch_from_model_config``; checkpoint errors of ``from_pretrained``.
    """
    dtype = torch_dtype(model_cfg.dtype)
    if model_cfg.path is not None:
        return from_pretrained(model_cfg.path, dtype=dtype, device=model_cfg.device)
    model = MoeForCausalLM(arch_from_model_config(model_cfg, vocab_size))
    model.init_weights()
    return model.to(device=model_cfg.device, dtype=dtype).keep_router_buffers_fp32()
