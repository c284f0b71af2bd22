"""FP8 weights: the DeepSeek-V3 release format loads exactly to the reference dequantization, and an FP8
rollout of a full-precision policy runs the reference math (dequantize, then matmul) on CPU."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _tiny import small_model_config
from safetensors.torch import load_file, save_file

import moerl.models as mm
from moerl.models import CheckpointError
from moerl.models.fp8 import (
    FP8_DTYPE,
    Fp8Experts,
    Fp8Linear,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_model_fp8,
)
from moerl.models.fp8_checkpoint import release_tensors, save_fp8_release


def _reference_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W = W_q.float() * scale_inv expanded per 128 x 128 block, written out by hand (float32)."""
    n, k = q.shape
    big = torch.empty(n, k)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            big[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = s[i, j]
    return q.float() * big


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes (torch.equal compares them exactly, NaN patterns included)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A DeepSeek-V3-shaped model (MLA with q LoRA, shared experts, sigmoid router with groups) 256 wide
    with experts 128 wide (several scale blocks, a partial block in the MLA projections), written in the
    release format over small shards, so that weights and their scales fall in different files."""
    torch.manual_seed(0)
    cfg = small_model_config("deepseek_v3", hidden_size=256, moe_intermediate_size=128)
    model = mm.build_model(cfg, vocab_size=40).eval()
    folder = tmp_path_factory.mktemp("fp8") / "release"
    save_fp8_release(model, folder, max_shard_bytes=150_000)
    return model, folder


def _dequantized_folder(folder, out):
    """The release dequantized by ``_reference_dequant``, written as a plain checkpoint."""
    tensors = {}
    for f in folder.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    plain = {}
    for key, t in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        plain[key] = _reference_dequant(t, tensors[key + "_scale_inv"]) if t.dtype == FP8_DTYPE else t
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_release_format_loads_to_the_reference_dequantization_exactly(release, tmp_path, dtype):
    _, folder = release
    assert len(list(folder.glob("*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").exists()
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]
    loaded = mm.from_pretrained(folder, dtype=dtype)
    reference = mm.from_pretrained(_dequantized_folder(folder, tmp_path / "plain"), dtype=dtype)
    quantized = {k for k, v in release_tensors(release[0]).items() if v.dtype == FP8_DTYPE}
    assert any("experts.3.down_proj" in k for k in quantized) and any("kv_b_proj" in k for k in quantized)
    for (n1, t1), (n2, t2) in zip(loaded.state_dict().items(), reference.state_dict().items(), strict=True):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2), n1
    # and it is not the original full-precision model (the weights went through FP8)
    assert not torch.equal(
        loaded.layers[1].mlp.experts.down_proj.float(), release[0].layers[1].mlp.experts.down_proj
    )


def test_fp8_load_keeps_the_release_bytes_and_scales(release):
    model, folder = release
    tensors = release_tensors(model)
    fp8 = mm.from_pretrained(folder, fp8=True)
    attn = fp8.layers[0].self_attn
    assert isinstance(attn.kv_b_proj, Fp8Linear) and isinstance(fp8.layers[1].mlp.experts, Fp8Experts)
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(_bits(attn.kv_b_proj.weight), _bits(tensors[key]))
    assert torch.equal(attn.kv_b_proj.weight_scale_inv, tensors[key + "_scale_inv"])
    experts = fp8.layers[1].mlp.experts
    up = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert torch.equal(_bits(experts.gate_up_proj[2, 128:]), _bits(tensors[up]))
    assert torch.equal(experts.gate_up_proj_scale_inv[2, 1:], tensors[up + "_scale_inv"])
    assert fp8.lm_head.weight.dtype == torch.float32  # embeddings, head, norms, router: not quantized
    # its forward is the dequantized model's (CPU: dequantize, then the same matmuls)
    ids = torch.randint(0, 40, (2, 7))
    dequantized = mm.from_pretrained(folder)
    assert torch.equal(fp8(ids).logits, dequantized(ids).logits)
    # a run from the release (init_from, float32) with rollout.weight_dtype=fp8 quantizes the dequantized
    # policy back to the release's very bytes and scales
    quantize_model_fp8(dequantized)
    requantized = dequantized.state_dict()
    for name, t in fp8.state_dict().items():
        assert torch.equal(_bits(t), _bits(requantized[name])), name


def test_quantize_blockwise_scales_and_bounds():
    torch.manual_seed(1)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different magnitude
    w[:128, :128] = 0  # an all-zero block
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and s.shape == (3, 2) and s.dtype == torch.float32
    assert s[0, 0] == 1.0 and torch.all(q[:128, :128].float() == 0)
    assert torch.equal(s[2, 1], w[256:, 128:].abs().max() / 448)
    back = dequantize_blockwise(q, s)
    assert torch.equal(back, _reference_dequant(q, s))
    scale = _reference_dequant(torch.ones(300, 200), s)
    # e4m3 (3 mantissa bits): |q - w/scale| is at most half a unit in the last place, 16 at the top (256-448)
    # and 2^-4 of the value in the normal range
    err = (back - w).abs() / scale
    assert torch.all(err <= 16) and torch.all(err <= (w / scale).abs() * 2**-4 + 2**-10)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        dequantize_blockwise(q, s[:2])


def test_release_errors_are_named(release, tmp_path):
    _, folder = release
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = {}
    for f in folder.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(bad / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"o_proj.weight is float8_e4m3fn but .* no .*o_proj.weight_scale_inv"
    ):
        mm.from_pretrained(bad)
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"weight_block_size=\[64, 64\]"):
        mm.from_pretrained(bad)
    with pytest.raises(CheckpointError, match=r"weight_block_size"):
        mm.check_model_folder(bad)


def test_quantized_model_runs_the_dequantized_weights_exactly():
    """The CPU FP8 path is the reference: a quantized model's logits equal those of a model whose weights
    are the dequantized ones; engine weight updates quantize full-precision tensors on load."""
    torch.manual_seed(2)
    model = mm.build_model(small_model_config("qwen3_moe", hidden_size=160), vocab_size=40).eval()
    fp8, deq = copy.deepcopy(model), copy.deepcopy(model)
    names = quantize_model_fp8(fp8)
    assert "layers.0.self_attn.q_proj" in names and "layers.1.mlp.experts" in names
    assert "lm_head" not in names and quantize_model_fp8(fp8) == []  # a second call finds nothing left
    with torch.no_grad():
        for name, mod in fp8.named_modules():
            if isinstance(mod, Fp8Linear):
                deq.get_submodule(name).weight.copy_(dequantize_blockwise(mod.weight, mod.weight_scale_inv))
            elif isinstance(mod, Fp8Experts):
                gu, dn = mod.dequantized(torch.float32)
                deq.get_submodule(name).gate_up_proj.copy_(gu)
                deq.get_submodule(name).down_proj.copy_(dn)
    ids = torch.randint(0, 40, (3, 9))
    assert torch.equal(fp8(ids).logits, deq(ids).logits)
    assert not torch.equal(fp8(ids).logits, model(ids).logits)
