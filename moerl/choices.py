"""The named choices the run config offers for models, in one place that imports nothing.

``moerl.config`` validates against these lists and ``moerl.models`` implements them; both import them
from here (the config module must stay importable without the model code, which imports it).
"""

from __future__ import annotations

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}
"""``architectures[0]`` of a Hugging Face ``config.json`` -> model family (``model_type``)."""

MODEL_FAMILIES: tuple[str, ...] = tuple(SUPPORTED_ARCHITECTURES.values())
"""Model families (``model.family``, transformers' ``model_type``) moerl implements."""

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")
"""Parameter dtypes by name (``model.dtype``, ``moerl generate --dtype``)."""
