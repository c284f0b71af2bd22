"""DeepSeek-V3's MTP module: the release's tensor names on save and load, a fresh module for a model
without one, the MTP loss training only the module, and online MTP training in the trainer."""

import json

import pytest
import torch
from _tiny import small_model_config, tiny_model
from safetensors import safe_open

from moerl.config import AlgorithmConfig, ConfigError, TrainerConfig
from moerl.models import build_model, from_pretrained, save_pretrained
from moerl.models.mtp import attach_fresh_mtp, has_mtp, mtp_loss
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.trainer.local import LocalTrainer

VOCAB = 32


def _mtp_model(family):
    torch.manual_seed(0)
    model = attach_fresh_mtp(build_model(small_model_config(family), VOCAB))
    with torch.no_grad():  # not the identity-like fresh init: every tensor distinct
        for p in model.mtp_layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def _mtp_out(model, ids):
    out = model(ids, return_hidden=True)
    pos = torch.arange(1, ids.shape[1]).expand(ids.shape[0], -1)
    return model.mtp_layers[0](model, out.hidden[:, :-1], ids[:, 1:], pos)[1]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_moe"])
def test_release_names_round_trip(tmp_path, family):
    model = _mtp_model(family)
    save_pretrained(model, tmp_path / "m")
    n = model.config.num_hidden_layers
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as h:
        keys = set(h.keys())
        assert torch.equal(h.get_tensor(f"model.layers.{n}.shared_head.head.weight"), model.lm_head.weight)
        assert torch.equal(h.get_tensor(f"model.layers.{n}.embed_tokens.weight"), model.embed_tokens.weight)
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.gate.weight",
    ):
        assert f"model.layers.{n}.{name}" in keys, name
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = from_pretrained(tmp_path / "m")
    assert loaded.config.num_nextn_predict_layers == 1
    for (a, x), (b, y) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert a == b and torch.equal(x, y), a
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_mtp_out(model, ids), _mtp_out(loaded, ids))


def test_release_without_mtp_tensors_loads_without_module(tmp_path):
    model = build_model(small_model_config("deepseek_v3"), VOCAB)
    save_pretrained(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1  # as a release converted without its MTP layer
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert not has_mtp(from_pretrained(tmp_path / "m"))


def test_missing_mtp_tensor_is_named(tmp_path):
    model = _mtp_model("deepseek_v3")
    save_pretrained(model, tmp_path / "m")
    from safetensors.torch import load_file, save_file

    f = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.eh_proj\.weight"):
        from_pretrained(tmp_path / "m")


def test_fresh_module_passes_the_hidden_state_through():
    model = tiny_model(VOCAB)
    assert not has_mtp(model)
    attach_fresh_mtp(model)
    layer = model.mtp_layers[0]
    assert model.config.num_nextn_predict_layers == 1 and has_mtp(model)
    h = model.config.hidden_size
    assert torch.equal(layer.eh_proj.weight[:, h:], torch.eye(h)) and not layer.eh_proj.weight[:, :h].any()
    before = dict(model.named_parameters())
    attach_fresh_mtp(model)  # idempotent
    assert dict(model.named_parameters()).keys() == before.keys()


def test_mtp_loss_trains_the_module_only():
    model = _mtp_model("qwen3_moe")
    ids = torch.randint(0, VOCAB, (3, 9))
    out = model(ids, return_hidden=True)
    loss, acc = mtp_loss(model, out.hidden, ids, torch.ones_like(ids))
    loss.backward()
    assert torch.isfinite(loss) and 0 <= float(acc) <= 1
    for name, p in model.named_parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        if name.startswith("mtp_layers."):
            assert has_grad or "router" in name or "experts" in name, name
        else:  # the policy, its shared embedding and head included: untouched by the MTP loss
            assert not has_grad, name
    # the hand-computed value: position i predicts ids[i + 2]
    logits = model.mtp_layers[0](model, out.hidden[:, :-2], ids[:, 1:-1], torch.arange(1, 8).expand(3, -1))[1]
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
    assert torch.allclose(loss, ref, atol=1e-6)


def _batch_groups():
    g = torch.Generator().manual_seed(4)
    groups = []
    for t in range(2):
        prompt = torch.randint(1, VOCAB, (3,), generator=g).tolist()
        task = RolloutTask(task_id=f"t{t}", prompt_ids=prompt, prompt_text="p", answer="a", num_samples=2)
        samples = []
        for i in range(2):
            resp = [(prompt[0] + 3 * j + i) % VOCAB for j in range(10)]  # a learnable pattern
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    response_logprobs=[-1.0] * 10,
                    loss_mask=[1] * 10,
                    finish_reason="stop",
                    policy_versions=[0] * 10,
                    reward=float(i),
                )
            )
        groups.append(Group.from_lease(Lease(task, "w", t + 1, 0.0), samples, 0.5))
    return groups


def test_online_mtp_training_in_the_trainer():
    torch.manual_seed(0)
    model = tiny_model(VOCAB, max_position_embeddings=64)
    trainer = LocalTrainer(model, TrainerConfig(mtp_loss_weight=1.0, lr=3e-2), AlgorithmConfig())
    assert has_mtp(model)
    batch = trainer.build_batch(_batch_groups(), 0)
    stats = [trainer.train_step(batch) for _ in range(10)]
    assert stats[0].mtp_loss is not None and stats[-1].mtp_loss < 0.7 * stats[0].mtp_loss
    assert stats[0].mtp_accuracy < 0.2 < 0.4 < stats[-1].mtp_accuracy
    off = LocalTrainer(tiny_model(VOCAB, max_position_embeddings=64), TrainerConfig(), AlgorithmConfig())
    assert off.train_step(off.build_batch(_batch_groups(), 0)).mtp_loss is None


def test_mtp_loss_weight_is_checked():
    with pytest.raises(ConfigError, match="trainer.mtp_loss_weight"):
        TrainerConfig(mtp_loss_weight=-1.0)
    with pytest.raises(ConfigError, match="num_ranks"):
        TrainerConfig(mtp_loss_weight=0.5, num_ranks=2)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_last_position_forward_equals_the_full_one(family):
    """The drafter's ``forward_last`` (MoE and head on the last position only) is ``forward``'s last
    position, under a mask that hides some leading keys of one row."""
    from moerl.models.model import causal_padding_mask

    model = _mtp_model(family).float()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 8, dtype=torch.int64)
    am[1, :3] = 0
    with torch.no_grad():
        hidden = model(ids, return_hidden=True).hidden[:, :-1]
        pos = torch.arange(1, 9).expand(2, -1)
        h, logits = model.mtp_layers[0](model, hidden, ids[:, 1:], pos, am)
        h1, l1 = model.mtp_layers[0].forward_last(model, hidden, ids[:, 1:], pos, causal_padding_mask(am))
    assert h1.shape == (2, 1, h.shape[-1]) and torch.allclose(h1, h[:, -1:], atol=1e-5)
    assert torch.allclose(l1, logits[:, -1:], atol=1e-5)
