"""CPU path of bench/ep_multi_gpu.py: two gloo ranks under torchrun at the tiny sizes, one timed iteration.

Checks the harness's byte accounting against the dispatchers' own (the floors send exactly what the
dispatchers send at R = 2), the round trip's output, the EP model's agreement with EP = 1 in float32, and
that every part wrote its figures. Timings are not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import transformers  # noqa: F401 - the test extra installs it: missing fails, not skips

ROOT = Path(__file__).resolve().parents[2]


def _row(rows: list[dict], topology: str, hidden: int, routing: str, method: str) -> dict:
    (row,) = [
        r
        for r in rows
        if (r["topology"], r["hidden"], r["routing"], r["method"]) == (topology, hidden, routing, method)
    ]
    return row


def test_ep_multi_gpu_cpu_run(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [
        str(ROOT / "bench" / "ep_multi_gpu.py"),
        "--out-dir",
        str(tmp_path),
        "--iters",
        "1",
        "--warmup",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "ep_multi_gpu.json").read_text())
    assert "error" not in result
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["env"]["NCCL_NVLS_ENABLE"] == "0"
    rows = result["dispatch"]
    assert len(rows) == 2 * 2 * 2 * 4  # topologies x hiddens x routings x methods
    for topology in ("2x1", "1x2"):
        for hidden in (64, 40):
            for routing in ("uniform", "zipf"):
                a2a, hier, floor, dedup = (
                    _row(rows, topology, hidden, routing, m)
                    for m in ("alltoall", "hierarchical", "floor_a2a", "floor_dedup")
                )
                # At R = 2 each node is one rank or one node holds both, so the hierarchical path sends one
                # row per (token, other rank), as the dedup floor does; the flat path one per copy.
                assert a2a["bytes_sent_all_ranks"] == floor["bytes_sent_all_ranks"] > 0
                assert hier["bytes_sent_all_ranks"] == dedup["bytes_sent_all_ranks"] > 0
                assert hier["bytes_sent_all_ranks"] < a2a["bytes_sent_all_ranks"]
                inter = a2a["inter_node_bytes_all_ranks"]
                assert inter == (a2a["bytes_sent_all_ranks"] if topology == "2x1" else 0)
                # combine(dispatch(x)) with identity experts = sum_j w_j x; partials travel in bf16
                assert a2a["out_rel_err"] < 5e-3 and hier["out_rel_err"] < 5e-3
    model = result["model"]
    for name in ("alltoall", "hierarchical"):
        for mode in ("free", "replayed"):
            v = model["agreement"][name][mode]
            assert v["routing_agreement"] == 1.0
            assert v["logits_rel_err"] < 1e-5 and v["grad_rel_err_max"] < 1e-5 and v["loss_rel_err"] < 1e-5
    assert set(model["train"]) == {"ep1", "alltoall", "hierarchical"}
    assert set(model["decode"]) == {"ep1_graphs", "ep1", "alltoall", "hierarchical"}
    assert model["decode"]["hierarchical"]["ep"] == 2
    assert all(v["tokens_per_s"] > 0 for part in ("train", "decode") for v in model[part].values())
