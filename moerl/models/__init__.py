"""Single-device MoE model code: attention, MoE block, families, Hugging Face checkpoint I/O.

Public API (docs/architecture.md, "Model"):
    from_pretrained(path, *, dtype=torch.float32, device="cpu") -> MoeForCausalLM
    save_pretrained(model, path)
    build_model(model_cfg: moerl.config.ModelConfig, vocab_size: int) -> MoeForCausalLM
    MoeForCausalLM(...)(input_ids, attention_mask=None, position_ids=None, *, cache=None,
                        forced_experts=None, return_routed_experts=False) -> CausalLMOutput
    MoeForCausalLM.moe_blocks() -> the MoeBlock of each MoE layer; replace ``block.experts`` to
        change how experts run (expert parallelism), keeping its call signature.
"""

from moerl.models.build import build_model
from moerl.models.checkpoint import CheckpointError, check_model_folder, from_pretrained, save_pretrained
from moerl.models.config import SUPPORTED_ARCHITECTURES, MoeConfig, RopeScaling, UnsupportedArchitectureError
from moerl.models.model import CausalLMOutput, MoeForCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLMOutput",
    "CheckpointError",
    "MoeConfig",
    "MoeForCausalLM",
    "RopeScaling",
    "UnsupportedArchitectureError",
    "build_model",
    "check_model_folder",
    "from_pretrained",
    "save_pretrained",
]
