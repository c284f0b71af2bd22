"""bench/r3_gpu.py runs on CPU at the tiny size and writes its figures."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import r3_gpu  # noqa: E402


def test_r3_bench_runs_on_cpu(tmp_path, capsys):
    out = r3_gpu.run("tiny", 2, 4, 3, torch.device("cpu"), runs=1, out_dir=tmp_path)
    a, d = out["agreement"], out["decode"]
    assert a["tokens"] == 6 and a["r3"]["expert_choices_differing"] == 0
    assert a["off"]["mean_abs_diff"] < 1e-4 and a["r3"]["mean_abs_diff"] < 1e-4  # float32 on both sides
    assert d["off"]["tokens"] == d["on"]["tokens"] == 6 and d["on_over_off"] > 0
    assert json.loads((tmp_path / "r3_gpu.json").read_text())["benchmark"] == "r3_gpu"
    assert "recording on / off" in capsys.readouterr().out
