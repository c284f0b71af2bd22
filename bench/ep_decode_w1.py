"""Eager decode of the EP model bench's model at EP world size 1 through the dispatcher path, on one GPU:
the in-context per-call cost of a dispatcher in a decode step (its host syncs stop the host from queueing
ahead of the device), measured without a peer.

    python bench/ep_decode_w1.py --device cuda        # run from a checkout that has bench/ep_multi_gpu.py

Runs ``bench.ep_multi_gpu.decode_throughput`` (64 requests, 128 + 128 tokens, temperature 1, no stop
tokens, CUDA graphs off as under EP) with no dispatcher (graphs on and off) and with each dispatcher on a
one-rank NCCL group. Per MoE layer and step: (EP step - plain eager step) / MoE layers. Writes
``<out-dir>/ep_decode_w1.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path.cwd()))

from bench.ep_multi_gpu import BIG, TINY, build_reference, decode_throughput  # noqa: E402
from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--label", default="")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29551")
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    sizes = BIG if dev.type == "cuda" else TINY
    ref = build_reference(sizes, dev)
    res = {}
    try:
        res["plain/graphs"] = decode_throughput(ref, None, sizes, dev, True)
        res["plain/eager"] = decode_throughput(ref, None, sizes, dev, False)
        for name, cls in (("alltoall", AllToAllDispatcher), ("hierarchical", HierarchicalDispatcher)):
            disp = cls(Topology(1, 1), sizes.model.num_experts)
            res[f"{name}/eager"] = decode_throughput(ref, disp, sizes, dev, False)
    finally:
        dist.destroy_process_group()
    layers = sizes.model.num_layers
    steps = sizes.new_tokens - 1
    for k, r in res.items():
        extra = (r["generate_ms"] - res["plain/eager"]["generate_ms"]) / steps / layers
        r["extra_ms_per_moe_layer_step"] = extra
        print(f"{a.label} EP world 1 decode {k:20s}: {r['generate_ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
              f"{extra:+.3f} ms per MoE layer and step vs plain eager")  # fmt: skip
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "ep_decode_w1", "label": a.label, "sizes": str(sizes),
               "moe_layers": layers, "results": res}  # fmt: skip
    (out / "ep_decode_w1.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
