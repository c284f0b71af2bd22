"""Model shapes for the planner: parameter counts, FLOPs and bytes of a Mixture-of-Experts decoder.

Shape legend: V vocabulary, H hidden size, L layers (L_d dense + L_m MoE), nh query heads, nkv KV heads,
hd head dim, E routed experts, k top-k (experts per token), S shared experts, I expert width,
I_d dense-layer FFN width, B batch rows, T sequence length.

Counts (bias-free SwiGLU decoders, as every preset here):
- SwiGLU FFN of width I: 3 H I parameters (gate, up, down), so 2 * 3 H I FLOPs per token.
- GQA attention: q and o are H x nh hd, k and v are H x nkv hd: H hd (2 nh + 2 nkv) parameters.
- MLA attention (DeepSeek-V2, arXiv:2405.04434, sec. 2.1; V3 arXiv:2412.19437 sec. 2.1.1): q_a H x q_lora,
  q_b q_lora x nh (d_nope + d_rope), kv_a H x (kv_lora + d_rope), kv_b kv_lora x nh (d_nope + d_v),
  o nh d_v x H. The KV cache holds the compressed latent and the shared rotary key: kv_lora + d_rope
  elements per token and layer.
- The forward pass costs 2 N FLOPs per token for N active matmul parameters, training 6 N (forward 2 N,
  backward 4 N; Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1), plus attention scores and values:
  2 * 2 T nh hd per token and layer forward, 12 L T nh hd for training without a causal discount (PaLM,
  Chowdhery et al. 2022, arXiv:2204.02311, App. B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moerl.configlib import ConfigError

ATTENTION_KINDS = ("gqa", "mla")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """Shape of a decoder-only MoE LM. Raises ConfigError on non-positive sizes or top_k > num_experts."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    """L: all decoder layers (dense + MoE)."""
    num_dense_layers: int = 0
    """L_d: leading layers with a dense FFN of width ``dense_intermediate_size`` instead of experts."""
    dense_intermediate_size: int = 0
    attention: str = "gqa"
    """``gqa`` (MHA when num_kv_heads == num_heads) or ``mla``."""
    num_heads: int
    num_kv_heads: int = 0
    """GQA key/value heads (0 = num_heads)."""
    head_dim: int = 128
    """GQA head dim; for MLA the query/key head dim is qk_nope_dim + qk_rope_dim."""
    q_lora_rank: int = 0
    """MLA query compression rank (0 = no compression: q is H x nh (d_nope + d_rope))."""
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    moe_intermediate_size: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_experts", "top_k"):
            if getattr(self, f) < 1:
                raise ConfigError(f"model.{f} must be >= 1, got {getattr(self, f)}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"model.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ConfigError(f"model.num_dense_layers must be in [0, {self.num_layers}]")

    # ------------------------------------------------------------------ parameter counts

    @property
    def num_moe_layers(self) -> int:
        """L_m = L - L_d."""
        return self.num_layers - self.num_dense_layers

    @property
    def attn_params_per_layer(self) -> int:
        """Attention projection parameters of one layer (formulas in the module docstring)."""
        h, nh = self.hidden_size, self.num_heads
        if self.attention == "gqa":
            nkv = self.num_kv_heads or nh
            return h * self.head_dim * (2 * nh + 2 * nkv)
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = h * self.q_lora_rank + self.q_lora_rank * nh * qk if self.q_lora_rank else h * nh * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * nh * (
            self.qk_nope_dim + self.v_head_dim
        )
        return q + kv + nh * self.v_head_dim * h

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert: 3 H I."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def embedding_params(self) -> int:
        """Embedding plus lm_head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def dense_params_per_moe_layer(self) -> int:
        """Parameters of an MoE layer that every token uses: attention, router H x E, shared experts."""
        h = self.hidden_size
        return (
            self.attn_params_per_layer + h * self.num_experts + self.num_shared_experts * self.expert_params
        )

    @property
    def dense_layer_params(self) -> int:
        """One leading dense layer: attention + 3 H I_d."""
        return self.attn_params_per_layer + 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of all MoE layers: L_m E 3 H I (the parameters expert parallelism shards)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def num_params(self) -> int:
        """Total parameters (norms neglected: < 0.01%)."""
        dense = (
            self.num_dense_layers * self.dense_layer_params
            + self.num_moe_layers * self.dense_params_per_moe_layer
        )
        return dense + self.routed_expert_params + self.embedding_params

    @property
    def non_expert_params(self) -> int:
        """Everything but the routed experts (replicated on every EP rank)."""
        return self.num_params - self.routed_expert_params

    @property
    def active_matmul_params(self) -> int:
        """N: matmul parameters multiplying each token (embedding lookup excluded, lm_head included), as
        Kaplan et al. 2020 count N: dense layers, attention, router, shared and k routed experts."""
        per_moe = self.dense_params_per_moe_layer + self.top_k * self.expert_params
        return (
            self.num_dense_layers * self.dense_layer_params
            + self.num_moe_layers * per_moe
            + self.vocab_size * self.hidden_size
        )

    # ------------------------------------------------------------------ FLOPs and bytes

    @property
    def attn_width(self) -> int:
        """nh * head dim of scores and values (MLA: nh (d_nope + d_rope) for scores, averaged with d_v)."""
        if self.attention == "gqa":
            return self.num_heads * self.head_dim
        return self.num_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim) // 2

    def forward_flops_per_token(self, context: float) -> float:
        """2 N + 4 L context (nh hd): one token's forward FLOPs at ``context`` cached tokens (decode/prefill)."""
        return 2.0 * self.active_matmul_params + 4.0 * self.num_layers * context * self.attn_width

    def train_flops_per_token(self, seq_len: float) -> float:
        """6 N + 12 L T (nh hd) (PaLM App. B, no causal discount): forward + backward FLOPs per token."""
        return 6.0 * self.active_matmul_params + 12.0 * self.num_layers * seq_len * self.attn_width

    def kv_bytes_per_token(self, elem_bytes: float = 2.0) -> float:
        """KV cache bytes of one token over all layers: GQA 2 nkv hd, MLA kv_lora + d_rope per layer."""
        if self.attention == "gqa":
            per_layer = 2 * (self.num_kv_heads or self.num_heads) * self.head_dim
        else:
            per_layer = self.kv_lora_rank + self.qk_rope_dim
        return self.num_layers * per_layer * elem_bytes

    def experts_touched(self, rows: float) -> float:
        """Expected distinct experts of one MoE layer hit by ``rows`` tokens under uniform routing:
        E (1 - (1 - k/E)^rows) (each expert is missed by a token with probability 1 - k/E)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** rows)

    def as_dict(self) -> dict:
        """Fields plus derived counts, for JSON output."""
        return {
            **asdict(self),
            "num_params": self.num_params,
            "active_matmul_params": self.active_matmul_params,
        }


GQA_COLUMNS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "num_experts", "top_k", "moe_intermediate_size")  # fmt: skip
"""A GQA preset row: V, H, L, nh, nkv (0 = MHA), hd, E, k, I; every layer MoE, no shared experts."""
MLA_COLUMNS = ("vocab_size", "hidden_size", "num_layers", "num_dense_layers", "dense_intermediate_size",
               "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
               "num_experts", "top_k", "num_shared_experts", "moe_intermediate_size")  # fmt: skip
"""An MLA preset row: V, H, L, L_d, I_d, nh, q_lora, kv_lora, d_nope, d_rope, d_v, E, k, S, I."""


def _gqa(name: str, *row: int) -> ModelShape:
    """The GQA preset ``name`` from one row of ``GQA_COLUMNS`` (ValueError at import on a short row)."""
    return ModelShape(name=name, attention="gqa", **dict(zip(GQA_COLUMNS, row, strict=True)))


def _mla(name: str, *row: int) -> ModelShape:
    """The MLA preset ``name`` from one row of ``MLA_COLUMNS`` (ValueError at import on a short row)."""
    return ModelShape(name=name, attention="mla", **dict(zip(MLA_COLUMNS, row, strict=True)))


# Rows: _mla(name, V, H, L, L_d, I_d, nh, q_lora, kv_lora, d_nope, d_rope, d_v, E, k, S, I)
#       _gqa(name, V, H, L, nh, nkv, hd, E, k, I)
# fmt: off
MODELS: dict[str, ModelShape] = {m.name: m for m in (
    # DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3): 671 B total, 37 B active.
    _mla("deepseek-v3",    129280, 7168, 61, 3, 18432, 128, 1536, 512, 128, 64, 128, 256, 8, 1, 2048),
    # Qwen3-30B-A3B config.json (huggingface.co/Qwen/Qwen3-30B-A3B): 30.5 B total, 3.3 B active.
    _gqa("qwen3-30b-a3b",   151936, 2048, 48, 32, 4, 128, 128, 8, 768),
    # Qwen3-235B-A22B config.json (huggingface.co/Qwen/Qwen3-235B-A22B): 235 B total, 22 B active.
    _gqa("qwen3-235b-a22b", 151936, 4096, 94, 64, 4, 128, 128, 8, 1536),
    # GLM-5-like: the GLM-5 technical report's table (arXiv:2602.15763, as tabulated at
    # glennklockwood.com/garden/GLM-5): 3 dense + 75 MoE layers, hidden 6144, MLA (q_lora 2048, kv_lora 512,
    # qk head 192 = 128 + 64 rotary, v head 256), 64 heads, 256 experts top-8 + 1 shared of width 2048,
    # dense FFN 12288, vocabulary 154880. DeepSeek Sparse Attention and the MTP layer are not modelled.
    _mla("glm5-744b-a40b", 154880, 6144, 78, 3, 12288, 64,  2048, 512, 128, 64, 256, 256, 8, 1, 2048),
    # moerl's bench models (bench/common.py SPECS; bench/ep_multi_gpu.py BIG.model).
    _gqa("reference",       50304,  2048, 16, 16, 0, 128, 64,  8, 1024),
    _gqa("reference4",      50304,  2048, 4,  16, 0, 128, 64,  8, 1024),
    _gqa("ep-bench",        50304,  2048, 4,  16, 4, 128, 64,  8, 1024),
    _gqa("tiny",            256,    64,   2,  4,  0, 16,  8,   2, 32),
)}
# fmt: on


def get_model(name: str) -> ModelShape:
    """The preset called ``name``. Raises ConfigError naming the presets when it is unknown."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
    return MODELS[name]
