"""Graph-mode decode of ``moerl.rollout.Engine`` at several batch sizes on one model (the planner's
held-out decode points): the settings of ``bench/rollout_gpu.py`` (P + N tokens, temperature 1, all prompts
prefilled in one step, ``sync_every=16``, CUDA graphs), median of ``--runs`` after a warm-up run.

    python bench/decode_points.py --device cuda --spec reference --batches 64 128

Uses ``bench.rollout_gpu.bench_engine`` and ``bench.common`` of the checkout it runs in (run it from an
older checkout's root to time that code). Writes ``<out-dir>/decode_points.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from bench.common import SPECS, build_hf, device_info, free_device_memory, moerl_from_hf  # noqa: E402
from bench.rollout_gpu import bench_engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 on CUDA, 8 on CPU")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 on CUDA, 8 on CPU")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    big = dev.type == "cuda"
    p, n = a.prompt_len or (128 if big else 8), a.new_tokens or (128 if big else 8)
    dtype = torch.bfloat16 if big else torch.float32
    spec = SPECS[a.spec]
    hf = build_hf(spec, dev, dtype, seed=0)
    model = moerl_from_hf(hf, dev, dtype)
    del hf
    free_device_memory(dev)
    points = []
    for b in a.batches:
        prompts = torch.randint(
            0, spec.vocab_size, (b, p), generator=torch.Generator().manual_seed(3)
        ).tolist()
        res, _ = bench_engine(model, prompts, n, 1.0, a.runs, 16, dev)
        res["batch"] = b
        points.append(res)
        print(f"{a.label} decode {a.spec} B={b} {p}+{n}: {res['tokens_per_s']:.0f} tok/s "
              f"(median {res['median_s']:.3f} s, prefill {res['prefill_only_s']:.3f} s, graphs {res['cuda_graphs']})")  # fmt: skip
    payload = {"benchmark": "decode_points", "label": a.label, **device_info(dev), "spec": a.spec,
               "prompt_len": p, "new_tokens": n, "points": points}  # fmt: skip
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_points.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
