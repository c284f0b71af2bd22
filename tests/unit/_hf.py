"""Tiny random transformers checkpoints that the parity tests against transformers share (``test_models_hf``,
``test_rollout_hf``). Importing this module skips the importing test module when transformers is missing."""

import torch
import transformers

HF_BASE = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
"""transformers config fields every family's tiny checkpoint has: vocab 64, hidden 32, 2 layers, 4 heads
(2 KV heads), top-2 of the experts, 64 positions."""


def save_random_hf_model(family: str, folder, seed: int, *, attn_implementation: str | None = None, **config):
    """A tiny transformers model of ``family`` (``AutoConfig.for_model(family, **config)``) with O(1)
    random weights from ``torch.Generator().manual_seed(seed)``, so that logits and routing are decisive:
    norms 1 + 0.1 N(0, 1), other parameters N(0, 1 / fan_in), DeepSeek-V3-style expert score correction
    biases 0.1 N(0, 1). ``attn_implementation``: set on the config when given ("eager"), else the
    default. Saved to ``folder`` (``save_pretrained``); returns the model in eval mode."""
    cfg = transformers.AutoConfig.for_model(family, **config)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(folder)
    return model
