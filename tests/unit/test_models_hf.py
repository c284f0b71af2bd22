"""Our logits vs transformers' on tiny random checkpoints of every supported family, both directions."""

from __future__ import annotations

import pytest
import torch
import transformers
from _hf import HF_BASE, save_random_hf_model

import moerl.models as mm

FAMILIES = {
    "qwen3_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
    ),
    "qwen2_moe": dict(
        intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4
    ),
    "mixtral": dict(intermediate_size=16, num_local_experts=4),
    "olmoe": dict(intermediate_size=16, num_experts=4),
    "deepseek_v3": dict(
        HF_BASE,
        num_hidden_layers=3,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "glm4_moe": dict(
        num_hidden_layers=3,
        intermediate_size=48,
        moe_intermediate_size=16,
        head_dim=8,
        n_routed_experts=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
}


def make_hf_model(family: str, folder, **overrides):
    """A tiny random transformers model with O(1) weights (so routing is decisive), saved to ``folder``."""
    kwargs = {**HF_BASE, **FAMILIES[family], **overrides}
    return save_random_hf_model(family, folder, seed=1, attn_implementation="eager", **kwargs)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((ref - out).abs().max() / ref.abs().max()).item()


def _inputs():
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = make_hf_model(family, tmp_path / "hf")
    ours = mm.from_pretrained(tmp_path / "hf")
    assert ours.config.model_type == family
    ids, mask = _inputs()
    with torch.no_grad():
        assert rel_err(hf(ids).logits, ours(ids).logits) < 1e-4
        real = mask.bool()
        ref, out = hf(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        assert rel_err(ref[real], out[real]) < 1e-4
        # left padding gives the same logits as the unpadded sequence
        assert rel_err(ours(ids[:1, 4:]).logits, out[:1, 4:]) < 1e-5
    # our checkpoint loads back in transformers with the same logits
    mm.save_pretrained(ours, tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (
            rel_err(hf(ids, attention_mask=mask).logits[real], hf2(ids, attention_mask=mask).logits[real])
            < 1e-6
        )


def test_tied_embeddings(tmp_path):
    hf = make_hf_model("qwen3_moe", tmp_path / "hf", tie_word_embeddings=True)
    ours = mm.from_pretrained(tmp_path / "hf")
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids, _ = _inputs()
    with torch.no_grad():
        assert rel_err(hf(ids).logits, ours(ids).logits) < 1e-4
    mm.save_pretrained(ours, tmp_path / "out")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert rel_err(hf(ids).logits, hf2(ids).logits) < 1e-6


def test_reads_fused_expert_layout_and_hf_shards(tmp_path):
    """transformers-5 in-memory (fused) keys, and transformers' own sharded output with and without index."""
    from safetensors.torch import save_file

    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    ids, mask = _inputs()
    real = mask.bool()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits[real]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for folder in (fused, tmp_path / "sharded"):
        with torch.no_grad():
            out = mm.from_pretrained(folder)(ids, attention_mask=mask).logits[real]
        assert rel_err(ref, out) < 1e-4
    (tmp_path / "sharded" / "model.safetensors.index.json").unlink()
    with torch.no_grad():
        out = mm.from_pretrained(tmp_path / "sharded")(ids, attention_mask=mask).logits[real]
    assert rel_err(ref, out) < 1e-4


def test_our_shards_load_in_transformers(tmp_path):
    make_hf_model("mixtral", tmp_path / "hf")
    ours = mm.from_pretrained(tmp_path / "hf")
    mm.save_pretrained(ours, tmp_path / "out", max_shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, _ = _inputs()
    with torch.no_grad():
        assert rel_err(ours(ids).logits, hf2(ids).logits) < 1e-5
