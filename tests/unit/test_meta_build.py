"""Building a policy on the meta device (``from_pretrained``, the memory preflight) runs no Python reference
kernel: torch's meta ``normal_`` and ``arange`` import ``torch._dynamo`` at their first call (seconds of
CPU in every rollout actor, driver and trainer that loads a policy), so the process must end without it."""

from __future__ import annotations

import os
import subprocess
import sys

from moerl.config import load_config
from moerl.models import build_model, save_pretrained

TINY = ["model.hidden_size=16", "model.num_layers=1", "model.num_experts=2", "model.top_k=1"]

CHECK = """
import sys
import torch
from moerl.models import from_pretrained
from moerl.rollout.memory_check import weight_bytes
model = from_pretrained(sys.argv[1])
assert weight_bytes(model.config, torch.float32) > 0
assert float(model.rotary.inv_freq[0]) == 1.0  # rebuilt on the real device after the meta build
print("torch._dynamo" in sys.modules)
"""


def test_loading_a_policy_imports_no_dynamo(tmp_path):
    save_pretrained(build_model(load_config(None, TINY).model, 40), tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "a meta-device build imported torch._dynamo"
