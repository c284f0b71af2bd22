"""A batch of zero sequences (an idle expert-parallel rank's micro-batch) runs forward and backward."""

from __future__ import annotations

import pytest
import torch
from test_models import ALL_FAMILIES, tiny


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_zero_sequences_forward_and_backward(family, with_mask):
    model = tiny(family).train()
    ids = torch.zeros(0, 5, dtype=torch.long)
    mask = torch.ones(0, 5, dtype=torch.long) if with_mask else None
    out = model(ids, attention_mask=mask, return_routed_experts=True)
    num_moe = sum(1 for _ in model.moe_blocks())
    k = model.config.num_experts_per_tok
    assert out.logits.shape == (0, 5, model.config.vocab_size)
    assert out.routed_experts.shape == (0, 5, num_moe, k)
    # no token: nothing to balance, and no NaN from a mean over zero tokens
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0
    (out.logits.sum() + out.aux_loss + out.z_loss).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_zero_sequences_with_forced_experts():
    model = tiny("qwen3_moe")
    num_moe = sum(1 for _ in model.moe_blocks())
    forced = torch.zeros(0, 4, num_moe, model.config.num_experts_per_tok, dtype=torch.long)
    out = model(torch.zeros(0, 4, dtype=torch.long), forced_experts=forced)
    assert out.logits.shape == (0, 4, model.config.vocab_size)
