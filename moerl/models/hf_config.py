"""Hugging Face ``config.json`` <-> ``MoeConfig`` fields, one small translation per family.

Reads both the transformers 5 form (``rope_parameters``) and the 4.x form (``rope_theta`` +
``rope_scaling``); writes the transformers 5 form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moerl.choices import SUPPORTED_ARCHITECTURES
from moerl.models.arch import MODEL_TYPES, RopeScaling, UnsupportedArchitectureError

if TYPE_CHECKING:
    from moerl.models.config import MoeConfig

_ROPE_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def model_type_of(d: dict[str, Any]) -> str:
    """The family of a parsed config.json, from ``architectures[0]`` (else ``model_type``).

    Raises:
        UnsupportedArchitectureError: naming the architecture and listing the supported ones.
    """
    archs = d.get("architectures") or []
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unknown architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        return SUPPORTED_ARCHITECTURES[archs[0]]
    if d.get("model_type") in MODEL_TYPES:
        return d["model_type"]
    raise UnsupportedArchitectureError(
        f"unknown architecture (model_type={d.get('model_type')!r}, no 'architectures'); "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling, float]:
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "yarn"):
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; use default, linear or yarn"
        )
    kwargs = {k: params[k] for k in _ROPE_KEYS if params.get(k) is not None}
    if rope_type == "yarn":
        kwargs.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    return theta, RopeScaling(rope_type=rope_type, **kwargs), partial


def _check_no_sliding_window(d: dict[str, Any], model_type: str) -> None:
    sliding = d.get("use_sliding_window", d.get("sliding_window") is not None) and d.get("sliding_window")
    if sliding:
        raise UnsupportedArchitectureError(
            f"{model_type}: sliding-window attention (sliding_window={d.get('sliding_window')}) is not supported"
        )


def hf_to_fields(d: dict[str, Any]) -> dict[str, Any]:
    """``MoeConfig`` keyword arguments from a parsed config.json (see ``MoeConfig.from_hf_dict``)."""
    mt = model_type_of(d)
    _check_no_sliding_window(d, mt)
    heads = d["num_attention_heads"]
    theta, scaling, partial = _rope(d)
    f: dict[str, Any] = dict(
        model_type=mt,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d.get("intermediate_size", 0),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
    )
    if mt in ("qwen3_moe", "qwen2_moe"):
        f.update(
            num_experts=d.get("num_experts") or d.get("num_local_experts"),
            moe_intermediate_size=d["moe_intermediate_size"],
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        )
    if mt == "qwen3_moe":
        bias = bool(d.get("attention_bias", False))
        f.update(qk_norm="head", qkv_bias=bias, o_bias=bias)
    elif mt == "qwen2_moe":
        f.update(
            qkv_bias=bool(d.get("qkv_bias", True)),
            shared_expert_gate=True,
            shared_intermediate_size=d.get("shared_expert_intermediate_size", 0),
            head_dim=d["hidden_size"] // heads,
        )
    elif mt == "mixtral":
        f.update(
            num_experts=d["num_local_experts"],
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
        )
    elif mt == "olmoe":
        bias = bool(d.get("attention_bias", False))
        f.update(
            num_experts=d["num_experts"],
            moe_intermediate_size=d["intermediate_size"],
            qk_norm="full",
            clip_qkv=d.get("clip_qkv"),
            qkv_bias=bias,
            o_bias=bias,
        )
    else:  # deepseek_v3, glm4_moe: sigmoid routing with group limits and a score-correction bias
        f.update(
            num_experts=d["n_routed_experts"],
            moe_intermediate_size=d["moe_intermediate_size"],
            scoring_func="sigmoid",
            use_score_correction_bias=True,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            shared_intermediate_size=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
            first_k_dense_replace=d.get("first_k_dense_replace", 0),
        )
    if mt == "deepseek_v3":
        bias = bool(d.get("attention_bias", False))
        f.update(
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            head_dim=d["qk_rope_head_dim"],
            rope_interleave=bool(d.get("rope_interleave", True)),
            qkv_bias=bias,
            o_bias=bias,
        )
    elif mt == "glm4_moe":
        f.update(
            qk_norm="head" if d.get("use_qk_norm") else "none", qkv_bias=bool(d.get("attention_bias", False))
        )
    return f


def _rope_parameters(c: MoeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": c.rope_scaling.rope_type}
    if c.rope_scaling.rope_type != "default":
        out["factor"] = c.rope_scaling.factor
    if c.rope_scaling.rope_type == "yarn":
        for k in _ROPE_KEYS[1:]:
            v = getattr(c.rope_scaling, k)
            if v is not None:
                out[k] = v
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    return out


def fields_to_hf(c: MoeConfig) -> dict[str, Any]:
    """The transformers 5 ``config.json`` dict of ``c`` (see ``MoeConfig.to_hf_dict``)."""
    d: dict[str, Any] = dict(
        architectures=[c.architecture],
        model_type=c.model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        hidden_act=c.hidden_act,
        rope_parameters=_rope_parameters(c),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        router_aux_loss_coef=c.router_aux_loss_coef,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        dtype="float32",
    )
    if c.num_nextn_predict_layers or c.model_type in ("deepseek_v3", "glm4_moe"):
        d["num_nextn_predict_layers"] = c.num_nextn_predict_layers
    mt = c.model_type
    if mt in ("qwen3_moe", "qwen2_moe"):
        d.update(
            num_experts=c.num_experts,
            moe_intermediate_size=c.moe_intermediate_size,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
            use_sliding_window=False,
        )
    if mt == "qwen3_moe":
        d.update(attention_bias=c.qkv_bias)
    elif mt == "qwen2_moe":
        d.update(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=c.shared_intermediate_size)
        d.pop("head_dim")
    elif mt == "mixtral":
        d.update(
            num_local_experts=c.num_experts, intermediate_size=c.moe_intermediate_size, sliding_window=None
        )
    elif mt == "olmoe":
        d.update(
            num_experts=c.num_experts,
            intermediate_size=c.moe_intermediate_size,
            clip_qkv=c.clip_qkv,
            attention_bias=c.qkv_bias,
        )
    else:
        d.update(
            n_routed_experts=c.num_experts,
            moe_intermediate_size=c.moe_intermediate_size,
            routed_scaling_factor=c.routed_scaling_factor,
            n_group=c.n_group,
            topk_group=c.topk_group,
            n_shared_experts=c.shared_intermediate_size // c.moe_intermediate_size,
            first_k_dense_replace=c.first_k_dense_replace,
            attention_bias=c.qkv_bias,
        )
    if mt == "deepseek_v3":
        d.update(
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            rope_interleave=c.rope_interleave,
        )
        d.pop("head_dim")
    elif mt == "glm4_moe":
        d.update(use_qk_norm=c.qk_norm == "head")
    return d
