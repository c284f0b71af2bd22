"""bench/spec_gpu.py (issue 49's GPU figure) runs end to end on CPU at the tiny shape (``--tiny``): the SFT
trains the MTP module, both workloads run with ``rollout.speculative`` off and mtp on the same requests,
the long tail speculates, the uniform batch above ``speculative_max_batch`` is turned down, the JSON
holds every override; bad arguments stop with one line before any model is built."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import spec_gpu  # noqa: E402


def _steady(figure: dict) -> list[dict]:
    return figure["passes"][1:]  # after the first (the one that warms up and captures)


def test_tiny_call_speculates_on_the_tail_and_turns_down_the_uniform_batch(tmp_path, capsys, monkeypatch):
    moved = []

    def sft_watched(model, *args, **kwargs):  # moerl's SFT, and whether it moved the MTP module
        before = [p.detach().clone() for p in model.mtp_layers.parameters()]
        loss = real_sft(model, *args, **kwargs)
        moved.append(
            sum(not torch.equal(a, b) for a, b in zip(before, model.mtp_layers.parameters(), strict=True))
        )
        return loss

    real_sft = spec_gpu.train_sft
    monkeypatch.setattr(spec_gpu, "train_sft", sft_watched)
    out = tmp_path / "spec_gpu.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: a second intra-op thread only spins on a busy machine
    try:
        result = spec_gpu.main(
            ["--device", "cpu", "--tiny", "--sft-steps", "2", "--eval-rows", "2", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["status"] == "complete"
    assert {"model.device=cpu", "trainer.mtp_loss_weight=1.0", "sft.steps=2"} <= set(result["overrides"])
    sft = result["sft"]
    assert len(moved) == 1 and moved[0] > 0  # the SFT trained the MTP module
    assert sft["held_out_after"]["mtp_loss"] != sft["held_out_before"]["mtp_loss"]
    tail, uniform = result["tail"], result["uniform"]
    for fig in (tail, uniform):  # the same requests each way: the same tokens, no speculation when off
        assert [p["tokens"] for p in fig["off"]["passes"]] == [p["tokens"] for p in fig["mtp"]["passes"]]
        assert all(p["spec_steps"] == 0 for p in fig["off"]["passes"])
        assert fig["ratio"] == fig["mtp"]["tokens_per_s"] / fig["off"]["tokens_per_s"]
    for p in _steady(tail["mtp"]):  # the long tail (6 rows) drafts and verifies
        assert p["spec_steps"] > 0 and p["spec_drafted"] > 0
        assert p["acceptance_rate"] == p["spec_accepted"] / p["spec_drafted"]
    assert 0.0 <= tail["mtp"]["acceptance_rate"] <= 1.0
    for p in _steady(uniform["mtp"]):  # 36 rows > speculative_max_batch (32): every step decodes plainly
        assert p["spec_steps"] == 0 and p["num_off_batch"] == p["decode_steps"] > 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[spec_gpu]")]
    assert [x.split(":")[0] for x in lines] == ["[spec_gpu] sft", "[spec_gpu] uniform", "[spec_gpu] tail"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--median-new", "50", "--max-new", "10"], "--median-new 50 must be at most --max-new 10"),
        (["--out", "result.txt"], "a .json file name"),
        (["--prompts", "0"], "--prompts 0 must be >= 1"),
        (["--mtp-loss-weight", "0"], "the MTP module must train"),
    ],
)
def test_bad_arguments_stop_with_one_line_before_any_model_is_built(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(spec_gpu, "build_and_sft", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as exc:
        spec_gpu.main(["--device", "cpu", "--tiny", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_more_tail_prompts_than_held_out_gsm8k_rows_is_refused_before_the_sft(monkeypatch, tmp_path):
    monkeypatch.setattr(spec_gpu, "build_and_sft", lambda *a: pytest.fail("built a model"))
    with pytest.raises(SystemExit, match="--prompts 65 > the 64 held-out GSM8K prompts"):
        spec_gpu.main(["--device", "cpu", "--tiny", "--prompts", "65", "--out", str(tmp_path / "s.json")])


def test_a_pass_that_would_end_past_the_budget_is_skipped_and_counted(monkeypatch):
    def fake_pass(engine, requests, device):
        return {"seconds": 100.0, "tokens_per_s": 7.0}, []

    monkeypatch.setattr(spec_gpu, "run", fake_pass)
    monkeypatch.setattr(spec_gpu, "timed_pass", fake_pass)
    monkeypatch.setattr(spec_gpu, "_spec_counters", lambda engine: dict.fromkeys(spec_gpu._COUNTERS, 0))
    saved, out = [], {}
    deadline = spec_gpu.time.perf_counter() + 50.0  # the first pass "took" 100 s: a second cannot fit
    spec_gpu.timed_passes(None, [], None, 3, out, deadline=deadline, on_pass=lambda: saved.append(1))
    assert len(out["passes"]) == 1 and out["passes_skipped"] == 2 and len(saved) == 1
    assert out["figure_from"] == "the first pass" and out["tokens_per_s"] == 7.0
    spec_gpu.timed_passes(None, [], None, 3, out := {}, deadline=None, on_pass=lambda: None)
    assert len(out["passes"]) == 3 and out["passes_skipped"] == 0
    assert out["figure_from"] == "passes after the first"


def test_a_way_that_fails_is_recorded_and_the_call_goes_on(monkeypatch, capsys):
    def fake_passes(engine, requests, device, passes, out, **kw):
        out["tokens_per_s"] = 5.0

    monkeypatch.setattr(spec_gpu, "timed_passes", fake_passes)
    out = {}
    cfg = spec_gpu.load_config(spec_gpu.CONFIG)
    # a policy without an MTP module: rollout.speculative=mtp cannot build its drafter
    spec_gpu.both_ways(None, cfg, lambda: SimpleNamespace(), [], torch.device("cpu"), 1, out)
    assert out["off"] == {"tokens_per_s": 5.0} and "ratio" not in out
    assert out["mtp"]["error"].startswith(
        "ValueError: rollout.speculative=mtp needs a policy with an MTP layer"
    )
    assert "Traceback" in capsys.readouterr().err
    line = spec_gpu.summary_line({"tail": out}, "tail")
    assert line.startswith("[spec_gpu] tail: no ratio") and "MTP layer" in line
