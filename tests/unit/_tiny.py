"""The tiny MoE policies that the unit tests share: the one of the worker, drain and trainer tests (16
wide, 4 experts, top-2), and the 2-layer one of the model and checkpoint tests (32 wide, any family)."""

import torch

from moerl.config import ModelConfig
from moerl.models import build_model


def tiny_model_config(**overrides) -> ModelConfig:
    """A 1-layer Qwen3-MoE config: hidden 16, 2 heads of 8 (1 KV head), 4 experts of width 8, top-2."""
    fields = dict(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
    )
    return ModelConfig(**{**fields, **overrides})


def tiny_model(vocab_size: int, **overrides) -> torch.nn.Module:
    """``build_model(tiny_model_config(**overrides), vocab_size)`` (random weights from torch's RNG)."""
    return build_model(tiny_model_config(**overrides), vocab_size)


def small_model_config(family: str, **overrides) -> ModelConfig:
    """``tiny_model_config`` of ``family``, wider and deeper: 2 layers, hidden 32, 4 heads of 8 (2 KV
    heads), 4 experts of width 16, top-2."""
    wider = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, moe_intermediate_size=16)
    return tiny_model_config(**{"family": family, **wider, **overrides})
