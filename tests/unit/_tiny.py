"""The tiny MoE policy that the worker, drain and trainer unit tests share (16 wide, 4 experts, top-2)."""

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
