"""Transformer layers of the moerl decoder: RMSNorm, rotary embeddings, GQA and MLA attention, SwiGLU MLP.

Shape legend: B batch, T new tokens, S attended tokens (cache + new), H hidden size, nh query heads,
nkv key/value heads, hd head dim, R rotary dim. Masks are boolean, True = attend.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moerl.models.config import MoeConfig, RopeScaling
from moerl.models.layer_kernels import (
    fused_rmsnorm,
    fused_rmsnorm_supported,
    fused_rotary,
    fused_rotary_supported,
)


class KVCache(Protocol):
    """The KV-cache seam owned by ``moerl.rollout`` (see docs/architecture.md, Model)."""

    attn_mask: torch.Tensor
    """[B, 1, T, S] bool, True = attend."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, nkv, T, hd] for layer ``layer_idx``; return all keys/values [B, nkv, S, hd]."""
        ...

    # Optional: a cache with ``fused_decode`` True for the bound forward also has
    # ``decode_attention(layer_idx, q, k, v, scale) -> [B, 1, nh * dv]`` (stores k, v and attends in place);
    # grouped-query attention layers then call it instead of ``update`` (``moerl.rollout.paged_kv_cache``).


def cache_is_latent(cache: KVCache | None) -> bool:
    """Whether ``cache`` holds MLA's latent (its optional ``latent`` attribute is True): MLA layers then
    ``update`` it with k = [c_kv, k_rope] [B, 1, T, kv_lora_rank + R] and an empty v [B, 1, T, 0]."""
    return cache is not None and bool(getattr(cache, "latent", False))


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 (Zhang & Sennrich 2019, Eq. 4)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rmsnorm_supported(x, self.weight):  # one Triton kernel on CUDA (moerl.models.layer_kernels)
            return fused_rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, Eq. 22), times ``mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] float32 and the cos/sin multiplier of a rotary embedding of width ``dim``.

    Default: theta^(-2i/R) (Su et al. 2021, RoFormer Eq. 15). Linear: divided by ``factor``. YaRN:
    NTK-by-parts blend of interpolated and extrapolated frequencies with a linear ramp between the
    correction dimensions of ``beta_fast`` and ``beta_slow`` rotations (Peng et al. 2023, Eq. 17-20).
    """
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / base
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type != "yarn":
        return inv_freq, 1.0
    s, orig = scaling.factor, scaling.original_max_position_embeddings
    attn = scaling.attention_factor
    if attn is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attn = _yarn_mscale(s, scaling.mscale) / _yarn_mscale(s, scaling.mscale_all_dim)
        else:
            attn = _yarn_mscale(s)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (inv_freq / s) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attn)


class RotaryEmbedding(nn.Module):
    """cos, sin [B, T, R] of positions ``position_ids`` [B, T] (float32 math, cast to the input dtype)."""

    def __init__(self, dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        if torch.empty(0).is_meta:  # a structure-only build (its buffer is rebuilt after ``to_empty``):
            # computed on the CPU, since torch's meta ``arange`` is a Python reference kernel whose first
            # call imports ``torch._dynamo`` (seconds of CPU a process, for values nobody reads)
            with torch.device("cpu"):
                inv_freq, self.attention_factor = rope_inv_freq(dim, theta, scaling)
            inv_freq = inv_freq.to("meta")
        else:
            inv_freq, self.attention_factor = rope_inv_freq(dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # (B, T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool = False
) -> torch.Tensor:
    """Rotate the first R channels of x [B, n, T, d] by position (RoFormer Eq. 34); the rest pass through.

    ``interleave``: pairs are (x0, x1), (x2, x3)... and the output lists the rotated evens then odds
    (DeepSeek's layout); otherwise pairs are (x_i, x_{i+R/2}).
    """
    if fused_rotary_supported(x, cos, sin, interleave):  # one Triton kernel on CUDA (layer_kernels)
        return fused_rotary(x, cos, sin)
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleave:
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:
        a, b = x_rot[..., : r // 2], x_rot[..., r // 2 :]
        out = x_rot * cos + torch.cat((-b, a), dim=-1) * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA of q [B, nh, T, d] over k, v [B, nkv, S, d]; returns [B, T, nh * dv]. ``mask`` [B, 1, T, S]
    bool, or None for plain causal attention over S = T keys (no padding, no cache)."""
    is_gqa = k.shape[1] != q.shape[1]  # grouped-query attention: each kv head serves nh / nkv query heads
    if is_gqa and q.device.type != "cpu":  # fused GPU kernels may not take enable_gqa: repeat k, v
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        is_gqa = False
    # On CPU, GQA inside SDPA: no repeated copies of k and v, no reduction of their gradients in backward.
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=is_gqa
    )
    return out.transpose(1, 2).flatten(2)


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with optional q/k RMSNorm, qkv clipping and bias."""

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.cfg = layer_idx, cfg
        nh, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=cfg.o_bias)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(nh * hd, cfg.rms_norm_eps), RMSNorm(nkv * hd, cfg.rms_norm_eps)
        self.scale = hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; ``mask`` [B, 1, T, S] bool (the cache's when ``cache`` is given), or
        None for plain causal attention (no cache)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (z.clamp(-cfg.clip_qkv, cfg.clip_qkv) for z in (q, k, v))
        # unflatten, not view(b, t, -1, hd): -1 is ambiguous when b == 0 (an idle EP rank's batch)
        q, k, v = (z.unflatten(-1, (-1, cfg.head_dim)) for z in (q, k, v))
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None and getattr(cache, "fused_decode", False):  # the cache attends in place
            return self.o_proj(cache.decode_attention(self.layer_idx, q, k, v, self.scale))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        return self.o_proj(_attend(q, k, v, mask, self.scale))


class MLAttention(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, Eq. 9-19).

    Queries (optionally low-rank: q_a -> RMSNorm -> q_b) and keys are split into a "nope" part and a
    rotary part; keys/values come from a shared latent c_kv of rank ``kv_lora_rank`` (kv_a -> RMSNorm ->
    kv_b) plus one rotary key shared by all heads. Two cache forms (``cache_is_latent``):

    - expanded: the cache stores the decompressed per-head k [B, nh, T, nope + rope] and v [B, nh, T, dv];
    - latent: the cache stores [RMSNorm(c_kv), k_rope] [B, 1, T, r + rope] (r = ``kv_lora_rank``). A
      one-token decode never decompresses it: W_UK (kv_b's key rows, [nh, nope, r]) is folded into the
      query, q_lat = q_nope W_UK, scores = q_lat c + q_rope k_rope (equal to q_nope k_nope + q_rope k_rope),
      all heads attend the one latent head, and W_UV ([nh, dv, r]) is applied to the attended latent
      (DeepSeek-V2 Sec. 2.1.2, "absorbed" projections). A prefill (T > 1) decompresses the cached latent.
    """

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.cfg = layer_idx, cfg
        h, nh, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=cfg.o_bias)
        self.scale = self.qk_head_dim**-0.5
        rs = cfg.rope_scaling
        if rs.rope_type == "yarn" and rs.mscale_all_dim:  # DeepSeek-V3's softmax temperature for YaRN
            self.scale *= _yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; ``mask`` [B, 1, T, S] bool, or None for plain causal attention."""
        cfg = self.cfg
        b, t, _ = x.shape
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (-1, self.qk_head_dim)).transpose(1, 2)  # (B, nh, T, nope + rope)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        q_rot = apply_rotary(q_rot, cos, sin, interleave=cfg.rope_interleave)
        k_rot = apply_rotary(k_rot.view(b, 1, t, rope), cos, sin, interleave=cfg.rope_interleave)
        if cache_is_latent(cache):
            entry = torch.cat([self.kv_a_layernorm(kv_latent)[:, None], k_rot], dim=-1)  # (B, 1, T, r + R)
            cached, _ = cache.update(self.layer_idx, entry, entry[..., :0])  # (B, 1, S, r + R)
            if t == 1:
                return self._absorbed_decode(q_nope, q_rot, cached, mask)
            return self._expanded_attend(q_nope, q_rot, cached, mask)
        kv = (
            self.kv_b_proj(self.kv_a_layernorm(kv_latent))
            .unflatten(-1, (-1, nope + cfg.v_head_dim))
            .transpose(1, 2)
        )
        k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)  # (B, nh, T, nope), (B, nh, T, dv)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if cache is not None and getattr(cache, "fused_decode", False):  # the cache attends in place
            return self.o_proj(cache.decode_attention(self.layer_idx, q, k, v, self.scale))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        return self.o_proj(_attend(q, k, v, mask, self.scale))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [nh, nope, r] and W_UV [nh, dv, r]: kv_b's rows of each head's keys and values (an FP8
        kv_b, ``rollout.weight_dtype=fp8``, dequantized to the layer's activation dtype)."""
        cfg = self.cfg
        kv_b = self.kv_b_proj
        w = (
            kv_b.dense_weight(self.kv_a_layernorm.weight.dtype)
            if hasattr(kv_b, "dense_weight")
            else kv_b.weight
        )
        w = w.unflatten(0, (-1, cfg.qk_nope_head_dim + cfg.v_head_dim))
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def _absorbed_decode(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One-token attention on the latent cache: q_nope [B, nh, 1, nope], q_rot [B, nh, 1, R],
        cached [B, 1, S, r + R], mask [B, 1, 1, S] -> [B, 1, H]. The nh heads are the query rows of one
        attention over the shared latent (k = cached, v = its first r channels), so every cached latent
        is read once per row, not once per head."""
        w_uk, w_uv = self._up_weights()
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # (B, nh, 1, r)
        q = torch.cat([q_lat, q_rot], dim=-1).transpose(1, 2)  # (B, 1, nh, r + R)
        r = self.cfg.kv_lora_rank
        out = F.scaled_dot_product_attention(q, cached, cached[..., :r], attn_mask=mask, scale=self.scale)
        out = torch.einsum("bthr,hvr->bthv", out, w_uv)  # (B, 1, nh, dv)
        return self.o_proj(out.flatten(2))

    def _expanded_attend(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of T queries over the decompressed latent cache (a prefill): q_nope [B, nh, T, nope],
        q_rot [B, nh, T, R], cached [B, 1, S, r + R], mask [B, 1, T, S] -> [B, T, H]."""
        cfg = self.cfg
        # (B, S, r), (B, S, R)
        c, k_rot = cached[:, 0].split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).unflatten(-1, (-1, cfg.qk_nope_head_dim + cfg.v_head_dim)).transpose(1, 2)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)  # (B, nh, S, nope), (.., dv)
        k = torch.cat([k_nope, k_rot[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        return self.o_proj(_attend(q, k, v, mask, self.scale))


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020, Eq. 5). x [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
