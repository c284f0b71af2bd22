"""moerl's SFT with the MTP loss (``train_sft(mtp_loss_weight=...)``): it trains the MTP module and leaves the
policy's SFT exactly as without it (the module's gradient is clipped apart from the policy's)."""

from __future__ import annotations

import copy

import pytest
import torch

from moerl.config import ModelConfig, SFTConfig
from moerl.models import build_model
from moerl.models.mtp import attach_fresh_mtp, has_mtp
from moerl.tasks import load_tokenizer
from moerl.tasks.base import Prompt
from moerl.tasks.sft import train_sft

SMALL = dict(
    family="qwen3_moe",
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=32,
    max_position_embeddings=64,
)
PROMPTS = [Prompt(id=f"p{i}", text=f"{i}+{i + 3}=", answer="", solution=f"{2 * i + 3}") for i in range(8)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only spins on a busy machine (19 s against 2 s seen)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sft(model, weight: float) -> float:
    tok = load_tokenizer()
    sft = SFTConfig(steps=3, batch_size=4, lr=3e-2, warmup_steps=0, aux_loss_coef=0.0)
    return train_sft(model, tok, PROMPTS, sft, seed=0, max_len=64, log_every=0, mtp_loss_weight=weight)


def _split(model):
    mtp = {f"mtp_layers.{k}": v for k, v in model.mtp_layers.state_dict().items()}
    policy = {k: v for k, v in model.state_dict().items() if k not in mtp}
    return policy, mtp


def test_mtp_loss_trains_the_mtp_module_and_never_the_policy():
    tok = load_tokenizer()
    torch.manual_seed(0)
    start = attach_fresh_mtp(build_model(ModelConfig(**SMALL), tok.vocab_size))
    without, with_mtp = copy.deepcopy(start), copy.deepcopy(start)
    loss_without = _sft(without, 0.0)
    loss_with = _sft(with_mtp, 1.0)
    p0, m0 = _split(start)
    p_without, m_without = _split(without)
    p_with, m_with = _split(with_mtp)
    assert any(not torch.equal(p0[k], p_with[k]) for k in p0)  # the policy trained
    for k in p0:  # ... exactly as without the MTP loss (same steps, same clipping of its own gradient)
        assert torch.equal(p_without[k], p_with[k]), k
    assert loss_with == loss_without
    assert all(torch.equal(m0[k], m_without[k]) for k in m0)  # weight 0: the module stays as it was
    assert sum(not torch.equal(m0[k], m_with[k]) for k in m0) > len(m0) // 2  # weight 1: it trains


def test_a_model_without_mtp_gets_a_fresh_one_and_a_negative_weight_is_refused():
    tok = load_tokenizer()
    model = build_model(ModelConfig(**SMALL), tok.vocab_size)
    with pytest.raises(ValueError, match="mtp_loss_weight=-1"):
        _sft(model, -1.0)
    assert not has_mtp(model)
    _sft(model, 1.0)
    assert has_mtp(model)
