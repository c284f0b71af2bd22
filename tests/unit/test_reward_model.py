"""Reward models on moerl's model code against transformers' own forward (dense and MoE bodies)."""

import json

import pytest
import torch
import transformers

from moerl.models.arch import UnsupportedArchitectureError
from moerl.models.reward_model import load_reward_model, pad_right, score_sequences

PAD = 63  # the pad id transformers looks for; never drawn in the sequences below
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_labels=1, pad_token_id=PAD)  # fmt: skip
BODIES = {
    "qwen3": dict(intermediate_size=48, head_dim=8),
    "llama": dict(intermediate_size=48, attention_bias=True),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
}


def save_hf_reward_model(family, folder, seed=0, **config):
    """A tiny transformers ``...ForSequenceClassification`` of ``family`` with O(1) random weights, saved."""
    cfg = transformers.AutoConfig.for_model(family, **{**TINY, **BODIES[family], **config})
    model = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", list(BODIES))
def test_scores_equal_transformers(family, tmp_path):
    hf = save_hf_reward_model(family, tmp_path)
    ours = load_reward_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, PAD, (n,), generator=gen).tolist() for n in (5, 11, 1, 8)]
    ids, mask = pad_right(seqs)
    with torch.no_grad():
        expected = hf(input_ids=ids.masked_fill(mask == 0, PAD), attention_mask=mask).logits[:, 0]
    got = torch.tensor(score_sequences(ours, seqs, batch_size=3))
    assert got.shape == (4,) and expected.abs().max() > 0.1  # decisive scores
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    assert len(ours.config.moe_layer_ids) == (2 if family == "qwen3_moe" else 0)


def test_unknown_body_and_damaged_folders_are_refused_in_one_line(tmp_path):
    save_hf_reward_model("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["GPT2ForSequenceClassification"]})
    )
    with pytest.raises(
        UnsupportedArchitectureError, match=r"^reward model architecture 'GPT2ForSequenceClass"
    ):
        load_reward_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="'Qwen3ForCausalLM' is not supported"):
        load_reward_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_reward_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="outside"):
        score_sequences(load_reward_model_ok(tmp_path / "ok"), [[70]], batch_size=1)


def load_reward_model_ok(folder):
    save_hf_reward_model("qwen3", folder)
    return load_reward_model(folder)


@pytest.mark.parametrize("num_experts", [0, 4])
def test_saved_reward_models_load_back_and_in_transformers(num_experts, tmp_path):
    from moerl.models.config import MoeConfig
    from moerl.models.reward_model import RewardModel, save_reward_model

    torch.manual_seed(0)
    cfg = MoeConfig(vocab_size=40, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                    intermediate_size=24, num_experts=num_experts, moe_intermediate_size=8, qk_norm="head",
                    pad_token_id=39)  # fmt: skip
    model = RewardModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_reward_model(model, tmp_path)
    seqs = [[1, 2, 3, 4], [5, 6]]
    want = score_sequences(model, seqs, batch_size=2)
    assert score_sequences(load_reward_model(tmp_path), seqs, batch_size=2) == pytest.approx(want, abs=1e-6)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    ids, mask = pad_right(seqs)
    with torch.no_grad():
        got = hf(input_ids=ids.masked_fill(mask == 0, 39), attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_preflight_refuses_a_bad_reward_folder_in_one_line(tmp_path):
    from moerl.config import ConfigError, load_config
    from moerl.run.preflight import check_reward_model

    save_hf_reward_model("qwen3", tmp_path / "rm")
    check_reward_model(load_config(None, [f"reward.model_path={tmp_path / 'rm'}"]), 64)  # vocab 64: fits
    with pytest.raises(ConfigError, match=r"vocab_size=64 is smaller than the policy tokenizer's 99"):
        check_reward_model(load_config(None, [f"reward.model_path={tmp_path / 'rm'}"]), 99)
    with pytest.raises(ConfigError, match=r"^reward.model_path='.*nothing': .*no config.json"):
        check_reward_model(load_config(None, [f"reward.model_path={tmp_path / 'nothing'}"]), 64)
    (tmp_path / "rm" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        check_reward_model(load_config(None, [f"reward.model_path={tmp_path / 'rm'}"]), 64)
