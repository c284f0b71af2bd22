"""Checkpoint folders: round trip, and bad input that gets a clear error with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import small_model_config
from safetensors.torch import load_file, save_file

import moerl.models as mm
import moerl.models.checkpoint as ckpt
from moerl.config import ConfigError
from moerl.models import CheckpointError, UnsupportedArchitectureError


def _saved(tmp_path, family="qwen2_moe"):
    model = mm.build_model(small_model_config(family), vocab_size=40).eval()
    mm.save_pretrained(model, tmp_path / "m")
    return model, tmp_path / "m"


def _edit_weights(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_round_trip_is_exact(tmp_path, family):
    model, folder = _saved(tmp_path, family)
    loaded = mm.from_pretrained(folder)
    assert loaded.config == model.config
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2), n1
    keys = load_file(str(folder / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys  # transformers' per-expert layout
    assert not list(tmp_path.glob(".m.*"))  # no temp folders left


def test_from_pretrained_dtype_and_overwrite(tmp_path):
    model, folder = _saved(tmp_path, "deepseek_v3")
    with torch.no_grad():
        next(model.moe_blocks()).router.e_score_correction_bias.fill_(0.25)
    mm.save_pretrained(model, folder)  # replacing an existing folder works
    bf = mm.from_pretrained(folder, dtype=torch.bfloat16)
    assert bf.lm_head.weight.dtype == torch.bfloat16 and not bf.training
    bias = next(bf.moe_blocks()).router.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.all(bias == 0.25)
    assert bf(torch.randint(0, 40, (1, 4))).logits.dtype == torch.bfloat16


def test_a_config_json_missing_a_needed_field_is_one_line_naming_it(tmp_path):
    """A config.json with a supported model_type but no head count: ``check_model_folder`` (the run's
    preflight) names the file and the missing field, no KeyError."""
    _, folder = _saved(tmp_path)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointError, match=r"config.json: no 'num_attention_heads'"):
        ckpt.check_model_folder(folder)


def test_unknown_architecture_lists_supported(tmp_path):
    _, folder = _saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        mm.from_pretrained(folder)


def test_missing_key_is_named(tmp_path):
    _, folder = _saved(tmp_path)
    _edit_weights(
        folder,
        lambda t: (
            t.pop("model.layers.1.mlp.shared_expert_gate.weight"),
            t.pop("model.layers.0.mlp.experts.2.up_proj.weight"),
        ),
    )
    with pytest.raises(CheckpointError, match="missing") as err:
        mm.from_pretrained(folder)
    assert "model.layers.1.mlp.shared_expert_gate.weight" in str(err.value)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in str(err.value)


def test_unexpected_key_is_named(tmp_path):
    _, folder = _saved(tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected weight keys \['model.layers.0.mlp.extra.weight'\]"
    ):
        mm.from_pretrained(folder)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    _, folder = _saved(tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(
        CheckpointError, match=r"model.layers.0.self_attn.q_proj.weight.*\(16, 32\).*\(32, 32\)"
    ):
        mm.from_pretrained(folder)
    _edit_weights(
        folder,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32),
                "model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(32, 8),
            }
        ),
    )
    with pytest.raises(CheckpointError, match=r"experts.0.down_proj.weight.*\(32, 8\).*\(32, 16\)"):
        mm.from_pretrained(folder)


def test_config_out_of_range(tmp_path):
    _, folder = _saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        mm.from_pretrained(folder)


def test_pickle_checkpoints_are_refused(tmp_path):
    _, folder = _saved(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        mm.from_pretrained(folder)


def test_nothing_written_on_error(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="MoeForCausalLM"):
        mm.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "a")
    assert list(tmp_path.iterdir()) == []
    model, folder = _saved(tmp_path)
    before = (folder / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        mm.save_pretrained(model, tmp_path / "b")
    with pytest.raises(OSError, match="disk full"):
        mm.save_pretrained(model, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no b, no temp folders
    assert (folder / "model.safetensors").read_bytes() == before  # the old checkpoint is untouched
