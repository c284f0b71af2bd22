"""Forward-pass contracts of MoeForCausalLM: padding, KV-cache seam, routing replay, build_model."""

from __future__ import annotations

import pytest
import torch
from _tiny import small_model_config

from moerl.config import ConfigError, ModelConfig
from moerl.models import MoeForCausalLM, build_model
from moerl.models.model import causal_padding_mask, positions_from_mask
from moerl.models.moe import MoeBlock

ALL_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"]


def tiny(family: str = "qwen3_moe", **kw) -> MoeForCausalLM:
    model = build_model(small_model_config(family, **kw), vocab_size=50)
    with torch.no_grad():  # O(1) weights so that routing and attention are far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.eval()


class ListCache:
    """A minimal KV cache honouring the seam: per-layer concatenation, mask set by the caller."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.attn_mask = torch.empty(0)
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def update(self, i, k, v):
        self.calls.append((i, tuple(k.shape)))
        self.k[i] = torch.cat([self.k[i], k], dim=2) if i in self.k else k
        self.v[i] = torch.cat([self.v[i], v], dim=2) if i in self.v else v
        return self.k[i], self.v[i]


def test_positions_and_mask_helpers():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    m = causal_padding_mask(mask)
    assert m.shape == (2, 1, 5, 5) and m.dtype == torch.bool
    assert m[0, 0, 3].tolist() == [False, False, True, True, False]
    assert m[0, 0, 0].tolist() == [True, False, False, False, False]  # pad query attends itself only


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_build_model_left_padding_and_replay(family):
    model = tiny(family)
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, return_routed_experts=True)
        alone = model(ids[:1, 3:], return_routed_experts=True)
        torch.testing.assert_close(out.logits[:1, 3:], alone.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.routed_experts[:1, 3:], alone.routed_experts)
        assert out.aux_loss.item() > 0 and out.z_loss.item() > 0
        num_moe = sum(1 for _ in model.moe_blocks())
        assert out.routed_experts.shape == (2, 7, num_moe, 2) and out.routed_experts.dtype == torch.int64
        # replaying the recorded routing reproduces the logits; other routing changes them
        replay = model(ids, attention_mask=mask, forced_experts=out.routed_experts)
        torch.testing.assert_close(replay.logits, out.logits)
        other = model(ids, attention_mask=mask, forced_experts=(out.routed_experts + 1) % 4)
        assert not torch.allclose(other.logits, out.logits, atol=1e-3)


def test_aux_loss_ignores_padding_tokens():
    model = tiny()
    ids = torch.randint(0, 50, (1, 6))
    padded = torch.cat([torch.full((1, 3), 7), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a, b = model(ids), model(padded, attention_mask=mask)
    assert a.aux_loss.item() == pytest.approx(b.aux_loss.item(), rel=1e-5)
    assert a.z_loss.item() == pytest.approx(b.z_loss.item(), rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_kv_cache_seam_matches_full_forward(family):
    model = tiny(family)
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in row 1
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache, pos = ListCache(), positions_from_mask(mask)
        cache.attn_mask = causal_padding_mask(mask[:, :5])
        steps = [model(ids[:, :5], position_ids=pos[:, :5], cache=cache).logits]
        for t in range(5, 8):
            cache.attn_mask = mask[:, None, None, : t + 1].bool()  # new token sees every real key so far
            steps.append(model(ids[:, t : t + 1], position_ids=pos[:, t : t + 1], cache=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=1e-5, rtol=1e-5)
    layers = [i for i, _ in cache.calls[:2]]
    assert layers == [0, 1]
    nkv = model.config.num_attention_heads if model.config.is_mla else model.config.num_key_value_heads
    assert cache.calls[0][1][:3] == (2, nkv, 5)


def test_bfloat16_forward_runs_and_router_logits_in_float32():
    model = tiny(dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    out = model(torch.randint(0, 50, (2, 5)))
    assert out.logits.dtype == torch.bfloat16 and out.aux_loss.dtype == torch.float32


def test_moe_blocks_and_layer_kinds():
    model = tiny("deepseek_v3")
    blocks = list(model.moe_blocks())
    assert len(blocks) == 1 and all(isinstance(b, MoeBlock) for b in blocks)  # layer 0 is dense
    assert model.layers[1].mlp is blocks[0]
    assert blocks[0].experts.gate_up_proj.shape == (4, 32, 32) and blocks[0].experts.down_proj.shape == (
        4,
        32,
        16,
    )


def test_bad_forward_inputs():
    model = tiny()
    ids = torch.randint(0, 50, (2, 5))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"forced_experts has shape \(2, 5, 1, 2\)"):
        model(ids, forced_experts=torch.zeros(2, 5, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids has shape"):
        model(ids, position_ids=torch.zeros(2, 3, dtype=torch.long))


def test_build_model_rejects_bad_config():
    with pytest.raises(ConfigError, match="model.top_k"):
        ModelConfig(num_experts=4, top_k=5)
    with pytest.raises(ConfigError, match="model.family='llama'"):
        ModelConfig(family="llama")
    with pytest.raises(ConfigError, match="model.head_dim=8 must equal"):
        build_model(ModelConfig(family="qwen2_moe", hidden_size=64, num_heads=4, head_dim=8), 50)


def test_rope_frequencies_hand_values():
    from moerl.models.config import RopeScaling
    from moerl.models.layers import rope_inv_freq

    inv, attn = rope_inv_freq(4, 100.0, RopeScaling())
    torch.testing.assert_close(inv, torch.tensor([1.0, 0.1]))  # 100^(-0/4), 100^(-2/4)
    assert attn == 1.0
    inv, _ = rope_inv_freq(4, 100.0, RopeScaling(rope_type="linear", factor=2.0))
    torch.testing.assert_close(inv, torch.tensor([0.5, 0.05]))
    # YaRN with no mscale: temperature 0.1 ln(4) + 1; the fastest dimension (many rotations over 4096
    # positions) is extrapolated (kept), the slowest interpolated (divided by the factor)
    inv, attn = rope_inv_freq(
        8, 10000.0, RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)
    )
    assert attn == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert inv[0].item() == pytest.approx(1.0) and inv[-1].item() == pytest.approx(10000 ** (-6 / 8) / 4)


def test_apply_rotary_rotates_pairs():
    from moerl.models.layers import apply_rotary

    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    c, s = torch.full((1, 1, 4), 0.0), torch.full((1, 1, 4), 1.0)  # rotation by 90 degrees
    # halves: pairs (x0, x2), (x1, x3) -> (-x2, -x3, x0, x1)
    assert apply_rotary(x, c, s).flatten().tolist() == [-3.0, -4.0, 1.0, 2.0]
    # interleaved: pairs (x0, x1), (x2, x3) -> evens (-x1, -x3) then odds (x0, x2)
    assert apply_rotary(x, c, s, interleave=True).flatten().tolist() == [-2.0, -4.0, 1.0, 3.0]
