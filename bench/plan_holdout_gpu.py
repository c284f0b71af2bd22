"""Fresh held-out points for the frozen planner: shapes the fit never used, timed on the moerl code the fit
measured, dated, tagged with the freeze they were taken against (``moerl/plan/holdout.py``).

    git archive 0f58815 moerl bench | (mkdir -p fitcode && tar -x -C fitcode)   # the fit's code (no .git needed)
    python3 bench/plan_holdout_gpu.py --device cuda --code fitcode               # one H200, ~2-3 min
    python3 bench/plan_holdout_gpu.py --device cpu --dry-run                     # plumbing check, tiny model

Points (reference model, bf16, one GPU): graph-mode decode at B = 32, 96, 192 (the fit used 256, the
later points 64 and 128), 128 + 128 tokens, as ``bench/rollout_gpu.py``; a training step at b12 x 1024
and b4 x 2048 (fit: b8 and b24 x 1024); one MoE block forward and forward + backward at 4096 and 32768
tokens (fit: 16384). Writes ``<out-dir>/plan_holdout_<UTC date and time>.json``, which ``moerl plan
--validate`` reads from ``bench/results``; the planner's predictions of the points are printed beside them.

``--code DIR`` is a copy of the moerl code to time (its ``moerl`` and ``bench`` are imported, so the
measurement is that code's); the file records ``freeze.moerl_digest`` of it, and the planner counts the
points as held out only when that equals the calibration's ``measured_code``. The freeze record is read
from this checkout's ``moerl/plan/calibration.json``. ``--dry-run`` times the tiny model at toy sizes and
marks the file ``dry_run`` (never held out); its default output folder is a new temporary one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
GPU_SIZES = {"spec": "reference", "decode_batches": (32, 96, 192), "prompt_len": 128, "new_tokens": 128,
             "train": ((12, 1024), (4, 2048)), "moe_tokens": (4096, 32768), "runs": 3, "steps": 3, "iters": 10}  # fmt: skip
DRY_SIZES = {"spec": "tiny", "decode_batches": (2,), "prompt_len": 8, "new_tokens": 4,
             "train": ((2, 32),), "moe_tokens": (32,), "runs": 1, "steps": 1, "iters": 1}  # fmt: skip


def _load_freeze_module():
    """``moerl/plan/freeze.py`` of this checkout under a private name (stdlib only), so that the ``moerl``
    imported later is the one of ``--code``."""
    spec = importlib.util.spec_from_file_location("_plan_freeze", HERE / "moerl" / "plan" / "freeze.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(code: Path, device: str, sizes: dict) -> tuple[dict, list[dict]]:
    """(device info, points) timed with the moerl and bench modules of ``code`` (see module docstring)."""
    sys.path.insert(0, str(code))
    import torch

    import moerl
    from bench.common import SPECS, build_hf, device_info, free_device_memory, moerl_from_hf
    from bench.moe_layer import _moerl_call, bench_block
    from bench.rollout_gpu import bench_engine
    from bench.train_step import bench_moerl, make_batch

    if not Path(moerl.__file__).resolve().is_relative_to(code):
        raise RuntimeError(f"moerl imported from {moerl.__file__}, not from --code {code}")
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    spec, name = SPECS[sizes["spec"]], sizes["spec"]
    hf = build_hf(spec, dev, dtype, seed=0)
    model = moerl_from_hf(hf, dev, dtype)
    del hf
    free_device_memory(dev)
    points, p, n = [], sizes["prompt_len"], sizes["new_tokens"]
    for b in sizes["decode_batches"]:
        prompts = torch.randint(
            0, spec.vocab_size, (b, p), generator=torch.Generator().manual_seed(3)
        ).tolist()
        res, _ = bench_engine(model, prompts, n, 1.0, sizes["runs"], 16, dev)
        points.append({"kind": "decode", "spec": name, "batch": b, "prompt_len": p, "new_tokens": n,
                       "tokens_per_s": res["tokens_per_s"], "median_s": res["median_s"],
                       "cuda_graphs": res["cuda_graphs"]})  # fmt: skip
        free_device_memory(dev)
    block = model.layers[0].mlp
    gen = torch.Generator(device=dev).manual_seed(7)
    for t in sizes["moe_tokens"]:
        x = torch.randn(t, spec.hidden_size, generator=gen, device=dev, dtype=dtype)
        r = bench_block(block, _moerl_call, x, torch.randn_like(x), dev, sizes["iters"])
        points.append({"kind": "moe_layer", "spec": name, "tokens": t, "fwd_ms": r["fwd"]["median_ms"],
                       "fwd_bwd_ms": r["fwd_bwd"]["median_ms"]})  # fmt: skip
        del x
        free_device_memory(dev)
    for b, s in sizes["train"]:
        times, _ = bench_moerl(model, make_batch(b, s, spec.vocab_size, s // 8), sizes["steps"], dev)
        points.append({"kind": "train_step", "spec": name, "batch": b, "seq_len": s,
                       "median_step_s": sorted(times)[len(times) // 2], "step_s": times})  # fmt: skip
        free_device_memory(dev)
    return device_info(dev), points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--code", default=str(HERE), help="moerl code to time (default: this checkout)")
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny model, toy sizes; the file is marked dry_run"
    )
    ap.add_argument(
        "--calibration",
        default=str(HERE / "moerl" / "plan" / "calibration.json"),
        help="the frozen calibration whose freeze record the file carries (default: this checkout's)",
    )
    ap.add_argument(
        "--out-dir", default=None, help="default bench/results (a new temporary folder with --dry-run)"
    )
    a = ap.parse_args(argv)
    if not a.dry_run and not a.device.startswith("cuda"):
        ap.error("a held-out point is an H200 measurement: --device cuda (or --dry-run for the plumbing)")
    freeze = _load_freeze_module()
    cal = json.loads(Path(a.calibration).read_text())
    code = Path(a.code).resolve()
    try:
        code_digest = freeze.moerl_digest(freeze.tree_files(code))
    except FileNotFoundError:
        ap.error(f"--code {a.code}: no moerl package there (give a copy of the moerl code to time)")
    if not cal.get("freeze"):
        ap.error(f"{a.calibration} has no freeze record: python -m moerl.plan.calibrate writes one")
    info, points = measure(code, a.device, DRY_SIZES if a.dry_run else GPU_SIZES)
    payload = {"benchmark": "plan_holdout", **info, "role": "held out", "dry_run": a.dry_run,
               "freeze": cal["freeze"], "model_digest_at_run": freeze.model_digest(cal, HERE / "moerl" / "plan"),
               "code": {"root": str(code), "moerl_digest": code_digest,
                        "matches_measured_code": code_digest == cal.get("measured_code", {}).get("moerl_digest")},
               "points": points}  # fmt: skip
    out = Path(
        a.out_dir or (tempfile.mkdtemp(prefix="plan_holdout_") if a.dry_run else HERE / "bench" / "results")
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"plan_holdout_{info['date'].replace(':', '').replace('+0000', 'Z')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    print(
        f"code timed: {code} (matches the fit's code {cal.get('measured_code', {}).get('commit')}: "
        f"{payload['code']['matches_measured_code']})"
    )
    _print_predictions(payload, path.name, a.calibration)
    return 0


def _print_predictions(payload: dict, name: str, calibration: str) -> None:
    """The frozen planner's predictions of the file's points (a fresh process: imports this checkout's
    moerl, which ``measure`` may have shadowed with ``--code``)."""
    import subprocess

    code = ("import json, sys; from pathlib import Path; from moerl.plan.validation import holdout_rows; "
            "cal = json.loads(Path(sys.argv[2]).read_text()); "
            "[print(f\"{r['quantity']}: measured {r['measured']:.4g}, predicted {r['predicted']:.4g} ({100 * r['rel_err']:+.1f}%)\") "
            "for r in holdout_rows(cal, json.loads(sys.stdin.read()), sys.argv[1])]")  # fmt: skip
    subprocess.run([sys.executable, "-c", code, name, calibration], input=json.dumps(payload), text=True, cwd=HERE,
                   env={**__import__("os").environ, "PYTHONPATH": str(HERE)}, check=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
