"""Contract of a model family (``moerl.models.keymaps.KEY_TABLES`` with its architecture in
``moerl.choices.SUPPORTED_ARCHITECTURES``; docs/extending.md "Model family"): every registered family,
and any new one, must build from a ``ModelConfig``, run a forward pass of the documented shapes
(``logits [B, T, V]``, ``routed_experts [B, T, L_moe, k]``), and survive a Hugging Face round trip
(``save_pretrained`` -> ``from_pretrained``): the same family, every tensor equal, the same logits.
(Fields a family does not use may come back otherwise: mixtral and olmoe, with no dense layers, do not
keep ``intermediate_size``.)"""

from __future__ import annotations

import pytest
import torch
from _tiny import small_model_config

import moerl.models as mm
from moerl.models.arch import MODEL_TYPES
from moerl.models.keymaps import KEY_TABLES

VOCAB = 40


def check_family_contract(model: torch.nn.Module, folder) -> None:
    """Assert the family contract (module docstring) of ``model``, saving it to ``folder``."""
    model = model.eval()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model(ids, return_routed_experts=True)
    k = model.config.num_experts_per_tok
    assert out.logits.shape == (2, 5, VOCAB), "logits [B, T, V]"
    assert out.routed_experts.shape == (2, 5, len(model.config.moe_layer_ids), k), "routed [B, T, L_moe, k]"
    mm.save_pretrained(model, folder)
    loaded = mm.from_pretrained(folder)
    assert loaded.config.model_type == model.config.model_type, "config.json names another family"
    theirs = loaded.state_dict()
    assert set(theirs) == set(model.state_dict()), "a tensor is lost or invented by the key table"
    assert all(torch.equal(t, theirs[n]) for n, t in model.state_dict().items()), "a tensor changed"
    assert torch.equal(loaded(ids).logits, out.logits), "the reloaded model computes otherwise"


@pytest.mark.parametrize("family", sorted(KEY_TABLES))
def test_registered_family_builds_runs_and_round_trips(family, tmp_path):
    torch.manual_seed(0)
    check_family_contract(mm.build_model(small_model_config(family), VOCAB), tmp_path / family)


def test_every_family_has_a_key_table_and_an_architecture():
    assert set(KEY_TABLES) == set(MODEL_TYPES)


def test_a_family_that_drops_a_tensor_on_save_is_refused(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = mm.build_model(small_model_config("qwen3_moe"), VOCAB)
    real = mm.save_pretrained

    def lossy(m, folder, **kw):
        with torch.no_grad():
            m.norm.weight.add_(1.0)  # what a wrong key table does: another tensor comes back
        real(m, folder, **kw)
        with torch.no_grad():
            m.norm.weight.sub_(1.0)

    monkeypatch.setattr(mm, "save_pretrained", lossy)
    with pytest.raises(AssertionError, match="a tensor changed"):
        check_family_contract(model, tmp_path / "m")
