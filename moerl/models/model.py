"""The decoder-only MoE language model (one device) and its output type.

Shape legend: B batch, T tokens, S attended tokens (cache + new), H hidden size, V vocabulary,
L_moe MoE layers, k experts per token. Masks are boolean, True = attend / real token.

Forward: embed -> L x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head, where mlp is a
``MoeBlock`` on MoE layers and a ``DenseMLP`` on the others (``MoeConfig.is_moe_layer``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moerl.models.config import MoeConfig
from moerl.models.layers import Attention, DenseMLP, KVCache, MLAttention, RMSNorm, RotaryEmbedding
from moerl.models.moe import MoeBlock, MoeLayerStats


@dataclass(frozen=True)
class CausalLMOutput:
    """Output of ``MoeForCausalLM.forward``. The router losses are computed on first read (then kept),
    so a caller that never reads them, such as the rollout engine's decode step, launches none of
    their kernels."""

    logits: torch.Tensor
    """[B, T, V] in the model dtype."""
    routed_experts: torch.Tensor | None = None
    """[B, T, L_moe, k] int64 chosen experts, when ``return_routed_experts``."""
    layer_stats: tuple[MoeLayerStats, ...] = ()
    """Router results of each MoE layer, in layer order (empty without MoE layers)."""
    hidden: torch.Tensor | None = None
    """[B, T, H] final hidden states after the last norm (the MTP module's input), when ``return_hidden``."""

    @functools.cached_property
    def aux_loss(self) -> torch.Tensor:
        """scalar float32: mean over MoE layers of the load-balancing loss (0 without MoE layers)."""
        return self._mean_over_layers("aux_loss")

    @functools.cached_property
    def z_loss(self) -> torch.Tensor:
        """scalar float32: mean over MoE layers of the router z-loss."""
        return self._mean_over_layers("z_loss")

    def _mean_over_layers(self, name: str) -> torch.Tensor:
        if not self.layer_stats:
            return torch.zeros((), dtype=torch.float32, device=self.logits.device)
        return torch.stack([getattr(s, name) for s in self.layer_stats]).mean()


class DecoderLayer(nn.Module):
    """Pre-norm transformer block with attention (GQA or MLA) and a dense or MoE MLP."""

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx) if cfg.is_mla else Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoeBlock(cfg) if cfg.is_moe_layer(layer_idx) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        token_mask: torch.Tensor | None,
        forced_idx: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MoeLayerStats | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoeBlock):
            y, stats = self.mlp(h, token_mask, forced_idx)
            return x + y, stats
        return x + self.mlp(h), None


class SharedHead(nn.Module):
    """The MTP release's ``shared_head``: its own final norm; the head matrix is the model's ``lm_head``."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpLayer(nn.Module):
    """One multi-token-prediction depth of DeepSeek-V3 (arXiv 2412.19437 Sec. 2.2, Eq. 21-23):

        h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])     (Eq. 21; embedding first, as the release)
        h_i^mtp = block(h'_i)                                 (Eq. 22: one decoder layer, causal)
        logits_i = lm_head(shared_head.norm(h_i^mtp))  ->  P(t_{i+2})   (Eq. 23)

    ``block`` is a ``DecoderLayer`` with index ``num_hidden_layers + depth`` (an MoE layer where the
    config's rules make one). Embedding and output head are the main model's (shared, Sec. 2.2), used
    detached: a loss on this module's logits never moves the policy.
    More in ``moerl.models.mtp``.
    """

    def __init__(self, cfg: MoeConfig, depth: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + depth)
        self.shared_head = SharedHead(cfg)

    def forward(
        self,
        model: MoeForCausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and logits of the token after next, without a KV cache (causal attention).

        Args:
            model: the main model (its ``embed_tokens``, ``lm_head``, ``rotary``).
            hidden: [B, T, H] h_i (the main model's ``CausalLMOutput.hidden``, or a previous depth's).
            next_ids: [B, T] int64 t_{i+1}, the token after position i.
            position_ids: [B, T] int64 the positions i + 1 of ``next_ids`` (rotary).
            attention_mask: [B, T] 1 = real position; None = all real.
            mask: [B, 1, T, T] bool (True = attend) given whole, instead of ``attention_mask``: no host
                sync (the rollout's drafter, replayed from a CUDA graph); every query must attend a key.
        Returns:
            h_mtp [B, T, H] (model dtype), logits [B, T, V] predicting t_{i+2}.
        """
        # the shared embedding and head enter detached: the MTP loss trains this module, never the policy
        emb = F.embedding(next_ids, model.embed_tokens.weight.detach())
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1))
        cos, sin = model.rotary(position_ids, x.dtype)
        if mask is None and attention_mask is not None and not bool(attention_mask.all()):  # device sync
            mask = causal_padding_mask(attention_mask)
        token_mask = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        h, _ = self.block(x, cos, sin, mask, None, token_mask, None)
        return h, F.linear(self.shared_head.norm(h), model.lm_head.weight.detach())

    def forward_last(
        self,
        model: MoeForCausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s outputs at the last position only (what a drafter needs), with the block's MLP
        (an MoE) and the output head on that position alone: every position still enters attention as a
        key/value, and the last query attends them; equal to ``forward(...)[:, -1:]``. No host sync.

        Args:
            hidden, next_ids, position_ids: as ``forward`` ([B, T, H], [B, T], [B, T]).
            mask: [B, 1, T, T] bool (True = attend), every query attending some key.
        Returns:
            h_mtp [B, 1, H] (model dtype), logits [B, 1, V] predicting the token after the last next id.
        """
        emb = F.embedding(next_ids, model.embed_tokens.weight.detach())
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1))
        cos, sin = model.rotary(position_ids, x.dtype)
        blk = self.block
        x = x[:, -1:] + blk.self_attn(blk.input_layernorm(x), cos, sin, mask, None)[:, -1:]
        y = blk.post_attention_layernorm(x)
        y = blk.mlp(y, None, None)[0] if isinstance(blk.mlp, MoeBlock) else blk.mlp(y)
        h = x + y
        return h, F.linear(self.shared_head.norm(h), model.lm_head.weight.detach())


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] int64 = (cumsum of the mask) - 1, clamped at 0, so left padding shifts nothing."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query i attends key j iff j <= i and j is a real token; a padding query also
    attends itself so that no row is empty (an empty row makes SDPA return NaN)."""
    t = attention_mask.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    return ((causal & attention_mask.bool()[:, None, :]) | eye)[:, None]


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, dim)`` on the ambient device, its weight ``[V, H]`` drawn from
    N(0, 1) as torch's own ``reset_parameters`` draws it (same generator calls, bitwise the same) except
    on the meta device, where there is nothing to draw: torch's meta ``normal_`` is a Python reference
    kernel whose first call imports ``torch._dynamo``, seconds of CPU that every process building a
    policy on the meta device (``from_pretrained``, each sharded trainer rank, each rollout actor) paid
    once for nothing."""
    weight = torch.empty(num_embeddings, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, dim, _weight=weight)


class MoeForCausalLM(nn.Module):
    """Decoder-only MoE language model; ``config`` is its ``MoeConfig``.

    ``moe_blocks()`` yields the ``MoeBlock`` of each MoE layer in order; an expert-parallel wrapper
    swaps ``block.experts`` for a module with the same call signature (see ``moerl.models.moe``).
    """

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = self.build_rotary()
        self.activation_checkpointing = False
        """Recompute each decoder layer in the backward pass (only while gradients are enabled)."""
        self.mtp_layers = nn.ModuleList(MtpLayer(cfg, j) for j in range(cfg.num_nextn_predict_layers))
        """Multi-token-prediction depths (``MtpLayer``; empty without one); ``forward`` never runs them."""

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``embed_tokens.weight`` when ``tie_word_embeddings`` (again after
        ``to_empty``, which allocates them separately)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def build_rotary(self) -> RotaryEmbedding:
        """A fresh rotary embedding for this config (its inv_freq buffer is not part of the state dict)."""
        cfg = self.config
        rot_dim = cfg.qk_rope_head_dim if cfg.is_mla else int(cfg.head_dim * cfg.partial_rotary_factor)
        return RotaryEmbedding(rot_dim, cfg.rope_theta, cfg.rope_scaling)

    def moe_blocks(self) -> Iterator[MoeBlock]:
        """The MoE blocks of the decoder layers in order (length L_moe; the MTP layers' are not among
        them: they stay whole on every EP rank)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoeBlock):
                yield layer.mlp

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        forced_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
        return_hidden: bool = False,
    ) -> CausalLMOutput:
        """Logits and router losses of ``input_ids`` [B, T] int64.

        Args:
            attention_mask: [B, T] (1 = token, 0 = padding); None = all tokens. Padding is excluded from
                attention (as keys) and from the aux/z losses.
            position_ids: [B, T] int64; None derives them from attention_mask (``positions_from_mask``).
                With a cache, pass them explicitly (the model does not know the cache offsets).
            cache: KV-cache seam; its ``attn_mask`` [B, 1, T, S] replaces the causal+padding mask.
            forced_experts: [B, T, L_moe, k] int64 routing to replay instead of the router's choice.
            return_routed_experts: fill ``routed_experts`` [B, T, L_moe, k].
            return_hidden: fill ``hidden`` [B, T, H] (after the final norm; the MTP module's input).
        Raises:
            ValueError: mismatched shapes of attention_mask / position_ids / forced_experts.
        """
        b, t = input_ids.shape
        num_moe = len(self.config.moe_layer_ids)
        if attention_mask is not None and attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(b, t)}")
        if forced_experts is not None and forced_experts.shape != (
            b,
            t,
            num_moe,
            self.config.num_experts_per_tok,
        ):
            raise ValueError(
                f"forced_experts has shape {tuple(forced_experts.shape)}; expected "
                f"{(b, t, num_moe, self.config.num_experts_per_tok)} [B, T, L_moe, k]"
            )
        if position_ids is None:
            position_ids = (
                positions_from_mask(attention_mask)
                if attention_mask is not None
                else torch.arange(t, device=input_ids.device).expand(b, t)
            )
        if position_ids.shape != (b, t):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected {(b, t)}")
        if cache is not None:  # a row with no key to attend would make SDPA return NaN: let it see all
            mask = cache.attn_mask | ~cache.attn_mask.any(-1, keepdim=True)
        elif attention_mask is not None and not bool(attention_mask.all()):  # device sync (no cache)
            mask = causal_padding_mask(attention_mask)
        else:  # no padding: None = plain causal attention (SDPA's is_causal, flash kernels on CUDA)
            mask = None
        token_mask = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        stats: list[MoeLayerStats] = []
        for layer in self.layers:
            forced = None
            if forced_experts is not None and isinstance(layer.mlp, MoeBlock):
                forced = forced_experts[:, :, len(stats)].flatten(0, 1)  # (B*T, k); B may be 0
            if self.activation_checkpointing and torch.is_grad_enabled():
                # per-layer activation checkpointing: only the layer's input is kept for backward
                x, s = checkpoint(layer, x, cos, sin, mask, cache, token_mask, forced, use_reentrant=False)
            else:
                x, s = layer(x, cos, sin, mask, cache, token_mask, forced)
            if s is not None:
                stats.append(s)
        normed = self.norm(x)
        logits = self.lm_head(normed)
        routed = None
        if return_routed_experts:
            k = self.config.num_experts_per_tok
            routed = (
                torch.stack([s.topk_idx.view(b, t, k) for s in stats], dim=2)  # k, not -1: B may be 0
                if stats
                else input_ids.new_zeros(b, t, 0, k)
            )
        hidden = normed if return_hidden else None
        return CausalLMOutput(logits=logits, routed_experts=routed, layer_stats=tuple(stats), hidden=hidden)

    def keep_router_buffers_fp32(self) -> MoeForCausalLM:
        """Cast ``e_score_correction_bias`` back to float32 after a ``.to(dtype)`` (selection precision)."""
        for block in self.moe_blocks():
            if block.router.e_score_correction_bias is not None:
                block.router.e_score_correction_bias.data = block.router.e_score_correction_bias.data.float()
        return self

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) weights, unit norms, zero biases and zero correction bias (GPT-2 style init)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)
        for block in self.moe_blocks():
            if block.router.e_score_correction_bias is not None:
                block.router.e_score_correction_bias.zero_()
