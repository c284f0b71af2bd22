"""The rollout engine's weight precision (``rollout.weight_dtype``): the registry ``WEIGHT_DTYPES``.

The engine runs its own copy of the policy (a worker's model), so its precision is independent of the
trainer's: ``auto`` keeps the policy's dtype (``model.dtype``: the rollout computes what the trainer
computes), ``bf16`` casts the copy to bfloat16, ``fp8`` block-quantizes its projections and experts to
float8_e4m3fn with 128 x 128 scales (``moerl.models.fp8``; activations keep the model dtype).

FP8 weights are quantized *on load in the engine*: the trainer publishes full-precision tensors, and
``Engine.update_weights`` quantizes each into the FP8 buffers (``moerl.models.fp8.copy_into_fp8``). The
bytes sent per version are therefore those of the policy dtype, not halved; the engine's weight memory
and its decode reads are halved against bf16. (Tensors that arrive already FP8, with their
``_scale_inv`` scales, are copied as they are, so a publisher that quantizes would halve the bytes too.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moerl.models.fp8 import quantize_model_fp8


def _keep(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    model.to(torch.bfloat16)
    if hasattr(model, "keep_router_buffers_fp32"):
        model.keep_router_buffers_fp32()
    return model


def _fp8(model: torch.nn.Module) -> torch.nn.Module:
    quantize_model_fp8(model)
    return model


WEIGHT_DTYPES: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "auto": _keep,
    "bf16": _bf16,
    "fp8": _fp8,
}
"""``rollout.weight_dtype`` name -> how the engine's copy of the policy is prepared (in place)."""


def prepare_rollout_model(model: torch.nn.Module, weight_dtype: str) -> torch.nn.Module:
    """The engine's model in ``weight_dtype`` (changed in place; pass the engine's own copy).

    Raises:
        ValueError: a name not in ``WEIGHT_DTYPES`` (the message lists them).
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"rollout weight_dtype={weight_dtype!r}; choose one of {sorted(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[weight_dtype](model)


def engine_weight_bytes(arch, model_dtype: torch.dtype, weight_dtype: str, *, ep_size: int = 1) -> int:
    """Bytes of one rollout engine's weights: the policy of ``arch`` (a ``moerl.models.MoeConfig``) in
    ``model_dtype``, prepared as ``weight_dtype`` (FP8 projections: 1 byte a weight plus a float32 scale
    per 128 x 128 block; the rest in the model dtype or bf16), counted on the meta device (nothing
    allocated). With ``ep_size`` > 1, 1/``ep_size`` of the routed experts (an EP rank's share).

    Raises:
        ValueError: an unknown ``weight_dtype``.
    """
    from moerl.models.model import MoeForCausalLM

    with torch.device("meta"):
        model = MoeForCausalLM(arch).to(model_dtype)
    if weight_dtype == "fp8":  # the structure only: quantizing meta tensors computes nothing
        quantize_model_fp8(model, empty=True)
    elif weight_dtype in WEIGHT_DTYPES:
        prepare_rollout_model(model, weight_dtype)
    else:
        raise ValueError(f"rollout weight_dtype={weight_dtype!r}; choose one of {sorted(WEIGHT_DTYPES)}")
    total = 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        total += nbytes // ep_size if ".mlp.experts." in name else nbytes
    return total
