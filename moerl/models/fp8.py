"""FP8 weights in the DeepSeek-V3 release format: 128 x 128 block scales, weight-only quantization.

The format (DeepSeek-V3 technical report, arXiv:2412.19437, Sec. 3.3.2 "fine-grained quantization"; the
release's ``config.json`` ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``): a weight W [N, K] is stored as
``W_q`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)], and

    W = W_q.float() * S,   S[n, k] = weight_scale_inv[n // 128, k // 128]     (the reference dequantization)

Stacked expert weights [E, N, K] carry scales [E, ceil(N/128), ceil(K/128)]. Quantization takes each
block's absolute maximum a: scale = a / 448 (448 = the largest e4m3 value), W_q = W / scale.

The rollout engine runs FP8 weights as *weight-only* quantization: activations stay in the model dtype
(bf16 on GPU), so the CPU path, which dequantizes a weight and multiplies, is the same math as the GPU
path up to the summation order (``moerl.models.fp8_kernels``: a Triton kernel that reads the FP8 bytes
and applies the block scale in its float32 accumulator). Decoding is memory-bound, so reading half the
bytes of bf16 weights is where the speed comes from; the activations' own quantization (DeepSeek's 1 x 128
activation scales and FP8 tensor-core GEMMs) is not done.

Shape legend: N output features, K input features, E experts, M rows (tokens), B = 128 the block side.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moerl.models.fp8_kernels import fp8_grouped_mm, fp8_mm_supported
from moerl.models.kernels import expert_layout, gather_sum_rows, swiglu
from moerl.models.moe import Experts, experts_forward

FP8_DTYPE = torch.float8_e4m3fn
"""The stored weight dtype (``fmt: e4m3``)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
BLOCK = 128
"""Side of a square scale block (``weight_block_size: [128, 128]``)."""
SCALE_SUFFIX = "_scale_inv"
"""A quantized tensor ``name`` has its scales under ``name + SCALE_SUFFIX`` (``weight_scale_inv``)."""


def scale_shape(shape: torch.Size | tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """Shape of the block scales of a weight of ``shape`` [..., N, K]: [..., ceil(N/B), ceil(K/B)]."""
    *lead, n, k = shape
    return (*lead, -(-n // block), -(-k // block))


def _expand(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """[..., nb, kb] block scales -> [..., N, K], each value repeated over its block."""
    return scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


def dequantize_blockwise(
    w_q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, *, block: int = BLOCK
) -> torch.Tensor:
    """The reference dequantization W = W_q.float() * S (module docstring), rounded once to ``dtype``.

    Args:
        w_q: [..., N, K] float8_e4m3fn (any float dtype is accepted and read as its values).
        scale_inv: [..., ceil(N/B), ceil(K/B)] float32.
        dtype: the result's dtype.
    Returns:
        [..., N, K] in ``dtype``, on w_q's device.
    Raises:
        ValueError: ``scale_inv``'s shape is not the block grid of ``w_q``.
    """
    if tuple(scale_inv.shape) != scale_shape(w_q.shape, block):
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a weight of shape {tuple(w_q.shape)} "
            f"in {block}x{block} blocks needs {scale_shape(w_q.shape, block)}"
        )
    n, k = w_q.shape[-2:]
    return (w_q.float() * _expand(scale_inv.float(), n, k, block)).to(dtype)


def quantize_blockwise(w: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a weight to float8_e4m3fn with one float32 scale per ``block`` x ``block`` block.

    Args:
        w: [..., N, K] floating point.
    Returns:
        ``(w_q, scale_inv)``: [..., N, K] float8_e4m3fn and [..., ceil(N/B), ceil(K/B)] float32, with
        scale = amax(|block|) / 448 (1 for an all-zero block), w_q = w / scale rounded to nearest.
    Raises:
        ValueError: ``w`` has fewer than 2 dimensions or is not floating point.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(
            f"quantize_blockwise needs a floating [..., N, K] weight, got {w.dtype} {tuple(w.shape)}"
        )
    *lead, n, k = w.shape
    nb, kb = scale_shape(w.shape, block)[-2:]
    wf = w.detach().float()
    padded = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    amax = padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block)).abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [..., nb, kb]
    w_q = (wf / _expand(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_q, scale


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
    """y = x @ W^T (+ bias) with W the dequantized weight: x [..., K], w_q [N, K] float8_e4m3fn,
    scale_inv [ceil(N/128), ceil(K/128)] -> [..., N] in x's dtype.

    CUDA bf16 with Triton: ``fp8_grouped_mm`` (FP8 bytes read, scale applied in the float32 accumulator);
    elsewhere the reference: ``dequantize_blockwise`` to x's dtype, then ``F.linear`` (exact to the
    reference dequantization followed by the same matmul).
    """
    if fp8_mm_supported(x):
        x2 = x.reshape(-1, x.shape[-1])
        offs = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)
        y = fp8_grouped_mm(x2, w_q.unsqueeze(0), scale_inv.unsqueeze(0), offs).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    return nn.functional.linear(x, dequantize_blockwise(w_q, scale_inv, x.dtype), bias)


class Fp8Linear(nn.Module):
    """A linear layer with a block-quantized weight: buffers ``weight`` [N, K] float8_e4m3fn and
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] float32 (the release's names), optional ``bias`` [N]."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale_inv", torch.ones(scale_shape((out_features, in_features))))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``quantize_blockwise(linear.weight)`` (and its bias), on its device."""
        with torch.device(linear.weight.device):  # allocated where the weight is (no host copy)
            out = cls(linear.in_features, linear.out_features, linear.bias)
        out.load_dense(linear.weight)
        return out

    @torch.no_grad()
    def load_dense(self, w: torch.Tensor) -> None:
        """Quantize a full-precision weight [N, K] into this layer's buffers (in place)."""
        q, s = quantize_blockwise(w.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(s)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] dequantized to ``dtype`` (``dequantize_blockwise``): for code that reads a
        projection's matrix itself (MLA's absorbed W_UK / W_UV, ``moerl.models.layers``). Recomputed per
        call from the FP8 buffers, so a CUDA graph replay sees the newest loaded version."""
        return dequantize_blockwise(self.weight, self.weight_scale_inv, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (``fp8_linear``)."""
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)


class Fp8Experts(nn.Module):
    """Routed SwiGLU experts with block-quantized stacked weights: buffers ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I] float8_e4m3fn with ``gate_up_proj_scale_inv`` [E, ceil(2I/128), ceil(H/128)]
    and ``down_proj_scale_inv`` [E, ceil(H/128), ceil(I/128)] float32; the call of ``Experts``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        gu, dn = (
            (num_experts, 2 * intermediate_size, hidden_size),
            (num_experts, hidden_size, intermediate_size),
        )
        self.register_buffer("gate_up_proj", torch.zeros(gu, dtype=FP8_DTYPE))
        self.register_buffer("gate_up_proj_scale_inv", torch.ones(scale_shape(gu)))
        self.register_buffer("down_proj", torch.zeros(dn, dtype=FP8_DTYPE))
        self.register_buffer("down_proj_scale_inv", torch.ones(scale_shape(dn)))

    @classmethod
    def from_experts(cls, experts: Experts) -> Fp8Experts:
        """An ``Fp8Experts`` holding the block-quantized weights of ``experts``, on their device."""
        e, i2, h = experts.gate_up_proj.shape
        with torch.device(experts.gate_up_proj.device):  # allocated where the weights are (no host copy)
            out = cls(e, h, i2 // 2)
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                q, s = quantize_blockwise(getattr(experts, name))
                getattr(out, name).copy_(q)
                getattr(out, name + SCALE_SUFFIX).copy_(s)
        return out

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in ``dtype`` by the reference dequantization."""
        return (
            dequantize_blockwise(self.gate_up_proj, self.gate_up_proj_scale_inv, dtype),
            dequantize_blockwise(self.down_proj, self.down_proj_scale_inv, dtype),
        )

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], topk_idx [N, k] int64, topk_weights [N, k] float32 -> [N, H] in x's dtype.

        CUDA bf16 with Triton: no host sync (counting sort, two FP8 grouped GEMMs, SwiGLU with the combine
        weights, gather-sum), so decode steps can be captured in CUDA graphs. Elsewhere the reference:
        the dequantized weights through ``moerl.models.moe.experts_forward``.
        """
        if fp8_mm_supported(x):
            k = topk_idx.shape[1]
            _, inverse, offsets, token, row_w = expert_layout(
                topk_idx, topk_weights, self.gate_up_proj.shape[0]
            )
            x_sorted = x.index_select(0, token)
            act = swiglu(
                fp8_grouped_mm(x_sorted, self.gate_up_proj, self.gate_up_proj_scale_inv, offsets), row_w
            )
            y = fp8_grouped_mm(act, self.down_proj, self.down_proj_scale_inv, offsets)
            return gather_sum_rows(y, inverse, None, k)
        gate_up, down = self.dequantized(x.dtype)
        return experts_forward(x, topk_idx, topk_weights, gate_up, down)


def is_fp8_linear_name(name: str) -> bool:
    """Whether a moerl module name is a linear layer that FP8 rollout quantizes: the attention and MLP
    projections of the decoder layers (``layers.{L}.self_attn.*_proj``, ``layers.{L}.mlp.*_proj``,
    shared experts), as the DeepSeek-V3 release does. Embeddings, the LM head, norms, routers and the
    shared-expert gate stay in the model dtype."""
    return name.startswith("layers.") and name.rsplit(".", 1)[-1].endswith("_proj")


def _modules_to_quantize(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and is_fp8_linear_name(name):
            yield name, module
        elif type(module) is Experts:
            yield name, module


def _empty_fp8(module: nn.Module) -> nn.Module:
    """An FP8 module of ``module``'s shape on its device, weights not set (zeros; meta on meta)."""
    with torch.device(next(module.parameters()).device):
        if isinstance(module, nn.Linear):
            return Fp8Linear(module.in_features, module.out_features, module.bias)
        e, i2, h = module.gate_up_proj.shape
        return Fp8Experts(e, h, i2 // 2)


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, *, empty: bool = False) -> list[str]:
    """Replace, in place, every quantizable linear layer (``is_fp8_linear_name``) by an ``Fp8Linear`` and
    every ``Experts`` by an ``Fp8Experts``, block-quantizing their weights (``quantize_blockwise``).

    Args:
        model: a ``MoeForCausalLM`` (any module tree with those layers).
        empty: only swap the modules (weights left unset; e.g. on the meta device before a checkpoint
            load fills them).
    Returns:
        The replaced module names. A module already FP8 is left alone (calling twice is harmless).
    """
    done = []
    for name, module in _modules_to_quantize(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if empty:
            new = _empty_fp8(module)
        elif isinstance(module, nn.Linear):
            new = Fp8Linear.from_linear(module)
        else:
            new = Fp8Experts.from_experts(module)
        setattr(parent, attr, new)
        done.append(name)
    return done


def fp8_state_names(model: nn.Module) -> set[str]:
    """Names of the model's FP8 tensors (``weight`` / ``gate_up_proj`` / ``down_proj`` of its FP8 modules);
    each has its scales under ``name + SCALE_SUFFIX``."""
    return {n for n, t in model.state_dict().items() if t.dtype == FP8_DTYPE}


@torch.no_grad()
def copy_into_fp8(targets: dict[str, torch.Tensor], name: str, src: torch.Tensor) -> None:
    """Write ``src`` into the FP8 tensor ``targets[name]`` and its scales ``targets[name + "_scale_inv"]``:
    a full-precision ``src`` is block-quantized here (``quantize_blockwise``); an FP8 ``src`` is copied
    as is (its scales arrive under their own name).

    Raises:
        KeyError: ``name`` has no scale tensor in ``targets``.
    """
    if src.dtype == FP8_DTYPE:
        targets[name].copy_(src)
        return
    q, s = quantize_blockwise(src.to(targets[name].device))
    targets[name].copy_(q)
    targets[name + SCALE_SUFFIX].copy_(s)


RELEASE_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The ``quantization_config`` of a DeepSeek-V3 FP8 release (what ``save_fp8_release`` writes)."""


def release_quantization(hf_config: dict) -> bool:
    """Whether a parsed ``config.json`` declares FP8 weights that moerl reads (module docstring).

    Returns:
        False without ``quantization_config``; True for ``quant_method: fp8``, ``fmt: e4m3`` (or absent)
        and ``weight_block_size: [128, 128]``.
    Raises:
        ValueError: a ``quantization_config`` of another method, format or block size (named).
    """
    q = hf_config.get("quantization_config")
    if q is None:
        return False
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ValueError(
            f"quantization_config.quant_method={method!r}: moerl reads only 'fp8' (DeepSeek-V3 blocks)"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt={q.get('fmt')!r}: moerl reads only 'e4m3'")
    if list(q.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size={q.get('weight_block_size')!r}: moerl reads only "
            f"[{BLOCK}, {BLOCK}] blocks"
        )
    return True
