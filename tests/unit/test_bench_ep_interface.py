"""bench/ep_interface_gpu.py (the EP interface's GPU check) runs on CPU: a row per registered dispatcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from moerl.ep import DISPATCHERS

ROOT = Path(__file__).resolve().parents[2]


def test_ep_interface_bench_runs_on_cpu(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, str(ROOT / "bench/ep_interface_gpu.py"), "--out-dir", str(tmp_path),
           "--tokens", "32", "--iters", "2", "--batch", "4", "--steps", "2"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "ep_interface_gpu.json").read_text())
    assert set(res["layer"]) == {"plain", *(f"ep1 {n}" for n in DISPATCHERS)}
    assert set(res["decode_ms_per_step"]) == {"engine/eager", *(f"ep1 {n}/eager" for n in DISPATCHERS)}
    assert all(r["ms"] > 0 and r["tflop_s"] > 0 for r in res["layer"].values())
    assert all(ms > 0 for ms in res["decode_ms_per_step"].values())
