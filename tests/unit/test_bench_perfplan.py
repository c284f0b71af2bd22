"""CPU checks of this round's EP single-rank plan, the planner's resolved assumptions, and CPU smoke runs of
the benchmarks that produced bench/results/perfplan (the GPU figures come from bench/perfplan_call.sh)."""

from __future__ import annotations

import json

import pytest
import torch

from moerl.ep import rows
from moerl.ep.comm import EPInputError, SingleRankInputs, check_single_rank
from moerl.plan.cli import effective_values
from moerl.plan.predict import Plan


def test_single_rank_layout_hand_example():
    # E = 3 experts with local order [2, 0, 1] (expert 2 first); slot ids t * k + j, k = 2
    idx = torch.tensor([[1, -1], [0, 5], [1, 2]])
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    local = torch.tensor([1, 2, 0])  # expert 0 -> local 1, expert 1 -> local 2, expert 2 -> local 0
    order, token, slot_row, row_w, counts, info = rows.single_rank_layout(idx, w, local, 3)
    # valid slots by local expert: local 0 (expert 2): slot 5; local 1 (expert 0): slot 2; local 2 (expert 1):
    # slots 0, 4; then the empty (-1) and out-of-range (5) slots 1, 3 in slot order
    assert order.tolist() == [5, 2, 0, 4, 1, 3]
    assert token.tolist() == [2, 1, 0, 2, 0, 1]
    assert slot_row.tolist() == [[2, -1], [1, -1], [3, 0]]
    assert row_w.tolist() == pytest.approx([0.6, 0.3, 0.1, 0.5, 0.2, 0.4])
    assert counts.tolist() == [1, 1, 2] and info.tolist() == [-1, 5, 4]


def test_check_single_rank_messages():
    ok = SingleRankInputs(None, (3, 4), 2, (torch.float32, torch.float32))
    check_single_rank(ok, 3)
    check_single_rank(ok, 3, (-1, 2))
    with pytest.raises(EPInputError, match=r"ids in \[-1, 5\]"):
        check_single_rank(ok, 3, (-1, 5))
    bad = SingleRankInputs("x must be [T, H], got shape (3,)", (3,), 0, (torch.float32, torch.float32))
    with pytest.raises(EPInputError, match="x must be"):
        check_single_rank(bad, 3)


def test_mission_assumptions_print_the_values_used():
    used = effective_values(Plan())
    assert used["top_k"].startswith("8 ") and used["train_share"].startswith("0.333")
    assert used["price_on_demand"].startswith("43.26") and used["interruptions_per_hour"].startswith("0.01")
    assert used["flat_net_fraction"].startswith("0.8")
    assert effective_values(Plan(top_k=2, price_on_demand=10.0))["top_k"].startswith("2 (plan")


def test_perfplan_benches_run_on_cpu(tmp_path, capsys):
    import transformers  # noqa: F401 - the test extra installs it: missing fails, not skips

    from bench import ep_engine_gpu, ep_percall

    assert ep_percall.main(["--device", "cpu", "--tokens", "4", "16", "--hidden", "16", "--iters", "2",
                            "--out-dir", str(tmp_path)]) == 0  # fmt: skip
    pc = json.loads((tmp_path / "ep_percall.json").read_text())
    assert len(pc["rows"]) == 4 and set(pc["fits"]) >= {"AllToAllDispatcher/events_ms"}
    args = [
        "--runs",
        "1",
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--new-tokens",
        "4",
        "--out-dir",
        str(tmp_path),
    ]
    assert ep_engine_gpu.main(args) == 0
    out = json.loads((tmp_path / "ep_engine_gpu.json").read_text())
    assert {"engine/graphs", "ep1 alltoall/eager", "ep1 hierarchical/graphs"} <= set(out["decode"])
    assert out["logits_same_routing"]["all fast paths"]["vs_reference"] == 0.0  # CPU: no fast paths
    assert "x1.000 of the engine" in capsys.readouterr().out
