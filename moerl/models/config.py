"""The architecture dataclass of a moerl MoE decoder, and its translation to/from Hugging Face config.json.

Field names follow Hugging Face ``config.json`` where one exists, so a reader who knows a family's
config knows ours. ``MoeConfig.from_hf_dict`` reads the config of any supported family
(``SUPPORTED_ARCHITECTURES``); ``MoeConfig.to_hf_dict`` writes one transformers loads back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moerl.choices import SUPPORTED_ARCHITECTURES
from moerl.configlib import ConfigError, check_choice, check_range
from moerl.models.arch import MODEL_TYPES, RopeScaling, UnsupportedArchitectureError
from moerl.models.hf_config import fields_to_hf, hf_to_fields

__all__ = [
    "MODEL_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "MoeConfig",
    "RopeScaling",
    "UnsupportedArchitectureError",
]


@dataclass(kw_only=True, slots=True)
class MoeConfig:
    """Architecture of a decoder-only MoE transformer (one device; parallel layout applied elsewhere).

    A layer ``i`` is an MoE layer when ``num_experts > 0``, ``i >= first_k_dense_replace``,
    ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; otherwise it is a dense
    SwiGLU MLP of width ``intermediate_size``.
    """

    model_type: str = "qwen3_moe"
    """Family, as transformers' ``model_type``: one of ``MODEL_TYPES``."""
    vocab_size: int = 256
    hidden_size: int = 64
    """Model width H."""
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """Key/value heads of grouped-query attention; divides num_attention_heads."""
    head_dim: int = 16
    """Per-head width hd for GQA attention (MLA uses the qk_*/v_head_dim fields)."""
    intermediate_size: int = 128
    """Width of dense MLP layers."""
    moe_intermediate_size: int = 64
    """Width I of each routed expert."""
    num_experts: int = 8
    """Routed experts E per MoE layer."""
    num_experts_per_tok: int = 2
    """Top-k: experts chosen per token."""
    norm_topk_prob: bool = False
    """Renormalize the k chosen weights to sum to 1 per token."""
    scoring_func: str = "softmax"
    """Router scores: softmax over experts, or an independent sigmoid per expert (DeepSeek-V3)."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed experts' combine weights (DeepSeek-V3)."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3 sec. 2.1.2); 1 disables."""
    topk_group: int = 1
    """Groups kept per token in group-limited routing."""
    use_score_correction_bias: bool = False
    """Router has ``e_score_correction_bias`` [E], added to scores for selection only (aux-loss-free balancing)."""
    shared_intermediate_size: int = 0
    """Width of the always-on shared expert MLP; 0: none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(w . x) (Qwen2-MoE)."""
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated (GLM-4.5 uses 0.5)."""
    rope_interleave: bool = False
    """Rotate interleaved pairs (x0, x1), (x2, x3) instead of halves (DeepSeek-V3 MLA)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    """none; ``head``: RMSNorm over each head of q and k (Qwen3); ``full``: over all of q and k (OLMoE)."""
    clip_qkv: float | None = None
    """Clamp q, k, v to [-clip_qkv, clip_qkv] (OLMoE)."""
    q_lora_rank: int | None = None
    """MLA: query compression rank; ``None``: a direct q projection."""
    kv_lora_rank: int = 0
    """MLA: key/value latent rank; 0 means standard GQA attention instead of MLA."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    """Recorded for round trips; the trainer's coefficient is ``TrainerConfig.aux_loss_coef``."""
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction depths (DeepSeek-V3 / GLM-4.5 ``config.json``; ``MoeForCausalLM.mtp_layers``,
    checkpoint layers ``num_hidden_layers + j``); 0: none."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_choice("model_type", self.model_type, list(MODEL_TYPES))
        check_choice("scoring_func", self.scoring_func, ["softmax", "sigmoid"])
        check_choice("qk_norm", self.qk_norm, ["none", "head", "full"])
        check_choice("hidden_act", self.hidden_act, ["silu"])
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "n_group",
            "topk_group",
            "decoder_sparse_step",
        ):
            check_range(name, getattr(self, name), 1)
        check_range("num_experts", self.num_experts, 0)
        check_range("num_nextn_predict_layers", self.num_nextn_predict_layers, 0)
        if self.num_experts:
            check_range("num_experts_per_tok", self.num_experts_per_tok, 1, self.num_experts)
            if self.num_experts % self.n_group:
                raise ConfigError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
            check_range("topk_group", self.topk_group, 1, self.n_group)
        check_range("partial_rotary_factor", self.partial_rotary_factor, 0.0, 1.0, lo_open=True)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.is_mla and min(self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ConfigError("MLA (kv_lora_rank > 0) needs qk_rope_head_dim >= 1 and v_head_dim >= 1")

    @property
    def is_mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V2/V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def architecture(self) -> str:
        """The ``architectures[0]`` name of config.json, e.g. ``Qwen3MoeForCausalLM``."""
        return MODEL_TYPES[self.model_type]

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a routed MoE block (else a dense MLP)."""
        return (
            self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        """Decoder layer indices that carry an MoE block, in order (the L_moe axis of routed_experts)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    # -- Hugging Face config.json ---------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MoeConfig:
        """Build from a parsed Hugging Face ``config.json``.

        Raises:
            UnsupportedArchitectureError: an architecture not in ``SUPPORTED_ARCHITECTURES`` (the message
                lists the supported ones) or a feature moerl does not implement (sliding windows).
            ConfigError: a field out of range, or a field the architecture needs that is missing.
        """
        try:
            fields = hf_to_fields(d)
        except KeyError as e:
            raise ConfigError(f"no {e.args[0]!r}, which the architecture needs") from None
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of this architecture (transformers 5 field names)."""
        return fields_to_hf(self)

    def replace(self, **changes: Any) -> MoeConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
