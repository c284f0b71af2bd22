"""CPU smoke of bench/weight_sync.py: every path delivers the trainer's weights to the engine process."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import weight_sync  # noqa: E402


def test_weight_sync_bench_runs_on_cpu(tmp_path, capsys):
    import ray

    try:
        out = weight_sync.main(
            ["--spec", "tiny", "--rounds", "1", "--bucket-mb", "0.05", "--out-dir", str(tmp_path)]
        )
    finally:
        ray.shutdown()
    assert set(out["results"]) == {
        "store",
        "cuda_ipc",
        "collective",
        "packed",
        "buckets",
    }  # pinned_host: CUDA
    assert all(r["weights_match"] and r["median_s"] > 0 for r in out["results"].values())
    assert out["floors_s"]["host_copy"] > 0 and out["floors_s"]["xxh3_host"] > 0
    assert out["results"]["cuda_ipc"]["num_buckets"] > 1  # small buckets: the ring of 2 is reused
    assert json.loads((tmp_path / "weight_sync_tiny_cpu.json").read_text())["benchmark"] == "weight_sync"
    assert "optimizer step -> the engine on the new version" in capsys.readouterr().out
