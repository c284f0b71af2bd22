"""Checkpoints: exact round trip of model/optimizer/RNG/scalars, atomic step folders, keep-last-N."""

import json
import random

import numpy as np
import pytest
import torch

from moerl.trainer import checkpoint as checkpoint_module
from moerl.trainer.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_step,
    restore_rng_state,
    save_checkpoint,
)


def trained_model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    step_with_fixed_grads(model, opt, seed=1)
    return model, opt


def step_with_fixed_grads(model, opt, seed):
    # gradients set by hand: the first autograd backward of a process costs seconds of lazy set-up
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def test_round_trip_model_optimizer_and_scalars(tmp_path):
    model, opt = trained_model_and_optimizer()
    extra = {
        "step": 7,
        "lr": 0.1 + 0.2,
        "name": "run",
        "flag": True,
        "none": None,
        "pair": (1, "a"),
        "by_id": {3: [1.5, float("inf")], (0, 1): "tuple key"},
        "arr": np.arange(4, dtype=np.uint32),
    }
    path = save_checkpoint(
        tmp_path, 7, {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": extra}
    )
    assert path == tmp_path / "checkpoints" / "step_7"
    assert read_checkpoint_step(path) == 7
    state = load_checkpoint(path)
    trainer = state["trainer"]
    assert trainer["lr"] == 0.1 + 0.2 and trainer["pair"] == (1, "a") and trainer["none"] is None
    assert trainer["by_id"] == {3: [1.5, float("inf")], (0, 1): "tuple key"}
    assert trainer["arr"].dtype == np.uint32 and trainer["arr"].tolist() == [0, 1, 2, 3]
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)

    # the restored model + optimizer take the same next step as the originals
    model2, opt2 = trained_model_and_optimizer()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    for m, o in ((model, opt), (model2, opt2)):
        step_with_fixed_grads(m, o, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_rng_streams_restored(tmp_path):
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move every stream on
    restore_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_crash_mid_write_leaves_no_visible_step(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}})
    write_part = checkpoint_module._write_part
    calls = []

    def crash_on_second_part(folder, name, part):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full")
        write_part(folder, name, part)

    monkeypatch.setattr(checkpoint_module, "_write_part", crash_on_second_part)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(2)}, "optimizer": {"x": 1}})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"], torch.ones(2))


def test_killed_writer_leftover_is_ignored_then_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, {"a": {"x": 1}})
    leftover = tmp_path / "checkpoints" / "step_2.tmp-dead"  # what a SIGKILLed writer leaves behind
    leftover.mkdir()
    (leftover / "a.json").write_text("{")
    assert latest_checkpoint(tmp_path).name == "step_1"
    save_checkpoint(tmp_path, 3, {"a": {"x": 3}})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_3"]


def test_keep_last_n_and_replace_same_step(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"a": {"step": step}}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    save_checkpoint(tmp_path, 4, {"a": {"step": 40}}, keep=2)
    assert load_checkpoint(latest_checkpoint(tmp_path))["a"] == {"step": 40}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_4"]
    meta = json.loads((tmp_path / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["parts"] == ["a"] and meta["step"] == 4


def test_tied_and_view_tensors(tmp_path):
    base = torch.arange(6.0).reshape(2, 3)
    path = save_checkpoint(tmp_path, 0, {"model": {"embed": base, "head": base, "row": base[1]}})
    state = load_checkpoint(path)["model"]
    assert torch.equal(state["head"], base) and torch.equal(state["row"], torch.tensor([3.0, 4.0, 5.0]))


def test_errors(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="part name 'bad/name'"):
        save_checkpoint(tmp_path, 1, {"bad/name": {}})
    with pytest.raises(TypeError, match="cannot store set at 'opt.x'"):
        save_checkpoint(tmp_path, 1, {"trainer": {"opt": {"x": {1, 2}}}})
    assert list_checkpoints(tmp_path) == []  # the failed save left nothing visible
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(tmp_path, -1, {})
