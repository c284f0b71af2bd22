"""bench/ep_host.py (host work of a world-size-1 EP round trip) runs on CPU and splits it at the read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ep_host_runs_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "bench/ep_host.py"), "--out-dir", str(tmp_path), "--calls", "5",
           "--repeats", "2"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    res = json.loads((tmp_path / "ep_host.json").read_text())["results"]
    assert set(res) == {
        f"{m}/{c}" for m in ("glue", "full") for c in ("AllToAllDispatcher", "HierarchicalDispatcher")
    }
    for r in res.values():  # the read was seen (work on both sides of it) and every figure is a time
        assert r["aten_ops_before_read"] > 0 and r["us_before_read"] > 0 and r["us_per_roundtrip"] > 0
