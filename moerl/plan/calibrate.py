"""Fit the planner's constants on moerl's own measurements (``bench/results/*.json``) and check the rest.

    python -m moerl.plan.calibrate [--results bench/results] [--out moerl/plan/calibration.json]

``--results`` defaults to the bench/results of the repository moerl is imported from (``args.RESULTS``), so
the command runs from any folder; a missing folder is a one-line usage error.

Every constant records the files, fields and points it was fitted on. Writing the record freezes the
model (``freeze``: date, commit, model digest): only runs recorded after it count as held out
(``moerl.plan.holdout``); the points of the files below that the fit does not use are "seen", not held
out, as they were measured before the freeze. Nothing here looks at the mission's +40%.

Fits (H200 datasheet peaks as the denominators, so the fractions carry to other GPUs):
- prefill_matmul_fraction: ``rollout_gpu.json`` prefill-only generate (B = 256 prompts of 128 tokens).
- decode_hbm_fraction, decode_step_s: the two CUDA-graph decode runs, linear in (bytes, 1):
  ``rollout_gpu.json`` (reference, 16 layers, B = 256) and ``ep_multi_gpu.json`` model.decode.ep1_graphs
  (4 layers, GQA, B = 64; its prefill, predicted, subtracted). Held out: the same code's graph-mode decode
  of the reference model at B = 64 and 128 (``perfplan/decode_points_base.json``).
- train_matmul_fraction, optimizer_hbm_fraction: ``train_step.json`` moerl/b8 and moerl/b24 (step time
  linear in tokens); held out: moerl/b16 and ``ep_multi_gpu.json`` model.train.ep1.
- moe_matmul_fraction: ``moe_layer.json`` moerl forward; held out: forward + backward (3x the FLOPs).
- eager_layer_s: ``ep_multi_gpu.json`` model.decode ep1 (eager) against ep1_graphs; held out: the EP = 2
  decode runs (eager step + one round trip per MoE layer at 64 tokens per GPU, whose fixed cost is
  ``decode_call_s``, below).
- decode_call_s per dispatcher: the per-call fixed cost at decode sizes, from the same code's round trips at
  EP world size 1 and T = 16..1024 (``perfplan/ep_percall_base.json``), not from the EP = 2 decode runs.
  The intercept of a line in T; its slope is not kept: the round trip does not grow with T over that
  range (hierarchical's slope comes out at -0.56 us/token, within the ~1 ms spread of the points), which
  the record's ``notes`` report. Read only when ``eager_decode`` is absent.
- decode_layer_w1_s per dispatcher and host_scale (``eager_decode``): what each dispatcher adds to an eager
  decode step per MoE layer at EP world size 1, inside the same decode loop and code
  (``perfplan/call2/ep_decode_w1_base.json``, one H200, 2026-12-01), and the host speed of the EP bench's
  machine against that one: the ratio of the two runs' own eager-minus-graphs time per layer of the plain
  engine (``ep_multi_gpu.json`` ep1 / ep1_graphs against the w1 file's plain/eager / plain/graphs). Eager
  decode is host-bound (host ~4 ms against ~1 ms of device work per layer), so per-call host costs move
  with the machine's host speed (1.7-2x between the two machines).
- measured_code: the moerl code these files timed (``MEASURED_CODE``) and its tree digest; the model
  predicts that code, so a new point must time it to test the model.
- EP round trip per dispatcher (call_s, proc_gb_s): ``ep_multi_gpu.json`` dispatch rows of topology 2x1
  (H 7168 / 4096, uniform / zipf); held out: the four 1x2 rows of each dispatcher. nvlink_fraction: the
  2x1 ``floor_a2a`` rows (plain all_to_all_single of the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch

from moerl.ep import ExpertPlacement, Topology, compute_layout
from moerl.ep.layout import copies_per_rank
from moerl.plan import freeze, timing
from moerl.plan.args import CALIBRATION, RESULTS
from moerl.plan.hardware import get_hardware
from moerl.plan.models import MODELS
from moerl.plan.traffic import RowBytes, exact_traffic

DEFAULT_OUT = CALIBRATION
H200 = get_hardware(
    "p5en"
)  # H200 datasheet peaks; the bench GPUs' NVLink pair: NV18 = 450 GB/s per direction


def _load(folder: Path, name: str) -> dict:
    path = folder / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(2, "bench result missing", str(path))
    return json.loads(path.read_text())


def bench_routing(tokens: int, experts: int, k: int, kind: str, seed: int) -> torch.Tensor:
    """The routing ``bench/ep_multi_gpu.py`` drew (same generator, seed and Gumbel-top-k), [T, k] int64."""
    gen = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen).clamp_min(1e-20)))
    if kind == "zipf":
        gumbel = gumbel - torch.log(torch.arange(1, experts + 1, dtype=torch.float32))
    return gumbel.topk(k, dim=-1).indices


def dispatch_points(ep: dict) -> list[dict]:
    """The bench's dispatch rows with the planner's bytes (exact, from the reproduced routing) and work bytes."""
    cfg, out = ep["dispatch_config"], []
    t, e, k = cfg["tokens_per_rank"], cfg["experts"], cfg["top_k"]
    for row in ep["dispatch"]:
        if row["method"] not in ("alltoall", "hierarchical", "floor_a2a"):
            continue
        n, g = (int(v) for v in row["topology"].split("x"))
        topo, h = Topology(n * g, g), row["hidden"]
        placement, rb = ExpertPlacement(e, topo), RowBytes(2 * h, k)
        idx = [
            bench_routing(t, e, k, row["routing"], 1000 * r + h + (row["routing"] == "zipf"))
            for r in range(n * g)
        ]
        lays = [compute_layout(i, placement) for i in idx]
        copies = torch.stack([copies_per_rank(lay, n * g) for lay in lays])
        dedup = torch.stack([lay.tokens_per_rank for lay in lays])
        if row["method"] == "hierarchical":
            work = (
                (dedup.sum(1) + dedup.sum(0)) * (rb.hier_dispatch + rb.combine) + copies.sum(0) * 4 * h
            ).max()
        else:
            work = ((copies.sum(1) + copies.sum(0)) * (rb.flat_dispatch + rb.combine)).max()
        label = "hier" if row["method"] == "hierarchical" else "flat"
        tr = exact_traffic(idx, placement, rb)
        sent = sum(
            x.intra_node_bytes + x.inter_node_bytes
            for p in ("dispatch", "combine")
            for x in tr[f"{label}_{p}"]
        )
        wire = int(max(copies[0, 1], copies[1, 0])) * (rb.flat_dispatch + rb.combine)
        out.append({**{f: row[f] for f in ("topology", "hidden", "routing", "method", "total_ms")},
                    "bytes_measured": row["bytes_sent_all_ranks"], "bytes_planned": int(sent),
                    "work_bytes": float(work), "wire_bytes": float(wire)})  # fmt: skip
    return out


PERCALL = "perfplan/ep_percall_base.json"
"""World-size-1 round trips of the issue-10 dispatchers (the code of every other file fitted here) at decode
token counts, measured by ``bench/ep_percall.py`` from a copy of that code (commit 0f58815)."""


W1 = "perfplan/call2/ep_decode_w1_base.json"
"""Eager decode of the EP bench model at EP world size 1 through each dispatcher and without one (issue-10
code, ``bench/ep_decode_w1.py``): the dispatchers' in-context cost per MoE layer and step."""


def _eager_decode(folder: Path, run_eager_layer_s: float, layers: int, steps: int) -> dict | None:
    """{w1_eager_layer_s, host_scale, decode_layer_w1_s: {method: s}} from ``W1`` (None when absent).

    ``host_scale`` = ``run_eager_layer_s`` (the EP bench run's plain eager minus graphs, per layer and step)
    / the same quantity of the w1 run: how much slower that machine's host runs the same eager loop."""
    path = folder / W1
    if not path.exists():
        return None
    res = json.loads(path.read_text())["results"]
    w1_layer = (res["plain/eager"]["generate_ms"] - res["plain/graphs"]["generate_ms"]) / 1e3 / steps / layers
    return {
        "w1_eager_layer_s": w1_layer,
        "host_scale": run_eager_layer_s / w1_layer,
        "decode_layer_w1_s": {
            m: res[f"{m}/eager"]["extra_ms_per_moe_layer_step"] / 1e3 for m in ("alltoall", "hierarchical")
        },
    }


def _percall(folder: Path) -> tuple[dict[str, dict[str, float]], list[str]]:
    """({method: {decode_call_s}}, notes) from ``PERCALL`` (({}, []) when the file is absent).

    Only the intercept of each line in T is kept. The slopes are not a measurement of a per-token cost:
    over T = 16..1024 the round trip does not grow with T (the spread between points exceeds any trend, and
    the hierarchical slope comes out negative), so the note reports them and nothing reads them."""
    path = folder / PERCALL
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    out, slopes = {}, []
    for method, key in (("alltoall", "AllToAllDispatcher"), ("hierarchical", "HierarchicalDispatcher")):
        f = data["fits"][f"{key}/events_ms"]
        out[method] = {"decode_call_s": f["call_ms"] / 1e3}
        ms = [r["events_ms"] for r in data["rows"] if r["dispatcher"] == key]
        slopes.append(
            f"{method} {1e3 * f['per_token_ms']:+.2f} us/token (points {min(ms):.2f}-{max(ms):.2f} ms)"
        )
    note = (
        f"{PERCALL}: per-token slopes of the decode-size round trips not used ({'; '.join(slopes)}): "
        "flat in T at T = 16..1024 within the spread of the points; work bytes use proc_gb_s"
    )
    return out, [note]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    a, b = np.linalg.lstsq(np.array([[1.0, x] for x in xs]), np.array(ys), rcond=None)[0]
    return float(a), float(b)


def fit(folder: Path) -> dict:
    """All constants with provenance (module docstring)."""
    roll, train, moe, ep = (
        _load(folder, n) for n in ("rollout_gpu", "train_step", "moe_layer", "ep_multi_gpu")
    )
    ref, epm, hw = MODELS["reference"], MODELS["ep-bench"], H200
    b, p, n_new = roll["batch"], roll["prompt_len"], roll["new_tokens"]
    prefill_flops = b * p * ref.forward_flops_per_token(p / 2)
    prefill_frac = prefill_flops / roll["results"]["moerl"]["prefill_only_s"] / (hw.bf16_tflops * 1e12)
    ctx = p + n_new / 2
    steps = n_new - 1
    bytes_ref = timing.decode_weight_bytes(ref, b, 1, 2) + b * ctx * ref.kv_bytes_per_token()
    dec1 = ep["model"]["decode"]["ep1_graphs"]
    b1 = 64
    pre1 = b1 * p * epm.forward_flops_per_token(p / 2) / (prefill_frac * hw.bf16_tflops * 1e12)
    bytes_ep = timing.decode_weight_bytes(epm, b1, 1, 2) + b1 * ctx * epm.kv_bytes_per_token()
    c_step, s_per_byte = _line(
        [bytes_ref, bytes_ep],
        [roll["results"]["moerl"]["decode_s"] / steps, (dec1["generate_ms"] / 1e3 - pre1) / steps],
    )
    # eager decode (no CUDA graphs, as under EP): the extra time per layer of ep1 without graphs
    eager = ep["model"]["decode"]["ep1"]
    eager_layer_s = ((eager["generate_ms"] - dec1["generate_ms"]) / 1e3 / steps) / epm.num_layers
    tr = train["results"]
    seq = train["seq_len"]
    fixed, s_per_token = _line(
        [8 * seq, 24 * seq], [tr["moerl/b8"]["median_step_s"], tr["moerl/b24"]["median_step_s"]]
    )
    train_frac = ref.train_flops_per_token(seq) / s_per_token / (hw.bf16_tflops * 1e12)
    opt_frac = ref.num_params * 14.0 / fixed / (hw.hbm_tb_s * 1e12)
    moe_frac = (
        moe["flops_fwd"] / (moe["results"]["moerl"]["fwd"]["median_ms"] / 1e3) / (hw.bf16_tflops * 1e12)
    )
    pts = dispatch_points(ep)
    impls = {}
    for method in ("alltoall", "hierarchical"):
        fit_pts = [q for q in pts if q["method"] == method and q["topology"] == "2x1"]
        call_ms, ms_per_byte = _line([q["work_bytes"] for q in fit_pts], [q["total_ms"] for q in fit_pts])
        impls[method] = {"call_s": call_ms / 1e3, "proc_gb_s": 1e-6 / ms_per_byte}
    percall, notes = _percall(folder)
    for method, q in percall.items():
        impls[method].update(q)
    floor = [q for q in pts if q["method"] == "floor_a2a" and q["topology"] == "2x1"]
    _, ms_per_wire = _line([q["wire_bytes"] / 2 for q in floor], [q["total_ms"] for q in floor])
    nvl_frac = 1e-6 / ms_per_wire / hw.nvlink_gb_s
    src = {
        "prefill_matmul_fraction": "rollout_gpu.json results.moerl.prefill_only_s (B=256, P=128, reference)",
        "decode_hbm_fraction": "rollout_gpu.json results.moerl.decode_s and ep_multi_gpu.json model.decode.ep1_graphs",
        "decode_step_s": "same two decode runs (intercept of step time against bytes)",
        "train_matmul_fraction": "train_step.json results moerl/b8 and moerl/b24 (slope)",
        "optimizer_hbm_fraction": "train_step.json results moerl/b8 and moerl/b24 (intercept: optimizer + fixed)",
        "moe_matmul_fraction": "moe_layer.json results.moerl.fwd (16384 tokens)",
        "eager_layer_s": "ep_multi_gpu.json model.decode ep1 (eager) minus ep1_graphs, per layer and step",
        "ep": "ep_multi_gpu.json dispatch rows, topology 2x1 (4 per dispatcher); nvlink_fraction: 2x1 floor_a2a",
        "ep_decode_call": f"{PERCALL}: the same code's dispatch + combine at EP world size 1 (one H200, NCCL), "
        "T = 16..1024 tokens, H = 2048, top-8 of 64, CUDA events; intercept of a line in T (decode_call_s; "
        "the slopes are not used, see notes)",
        "eager_decode": f"{W1}: decode_layer_w1_s = (EP world 1 eager decode - plain eager decode) per MoE "
        "layer and step (64 requests, 128 + 128, same code and loop as the EP bench); w1_eager_layer_s = "
        "(plain eager - plain graphs) per layer and step of that run; host_scale = eager_layer_s / "
        "w1_eager_layer_s (both machines' own non-EP eager decode; not the EP = 2 points)",
    }
    eager_decode = _eager_decode(folder, eager_layer_s, epm.num_layers, steps)
    return {
        "constants": {
            "decode_hbm_fraction": 1.0 / (s_per_byte * hw.hbm_tb_s * 1e12), "decode_step_s": c_step,
            "prefill_matmul_fraction": prefill_frac, "train_matmul_fraction": train_frac,
            "moe_matmul_fraction": moe_frac, "optimizer_hbm_fraction": opt_frac,
            "eager_layer_s": eager_layer_s,
        },
        "ep_impls": impls,
        **({"eager_decode": eager_decode} if eager_decode else {}),
        "nvlink_fraction_all_to_all": nvl_frac,
        "measured_code": measured_code(),
        "notes": notes,
        "dispatch_points": pts,
        "sources": src,
        "device": {n: _load(folder, n).get("device") for n in ("rollout_gpu", "train_step", "moe_layer", "ep_multi_gpu")},
        "dates": {n: _load(folder, n).get("date") for n in ("rollout_gpu", "train_step", "moe_layer", "ep_multi_gpu")},
        "denominators": "H200 datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM, NVLink 450 GB/s per direction",
    }  # fmt: skip


MEASURED_CODE = "0f58815"
"""The moerl code the fitted files measured: the issue-10 code (rollout_gpu, train_step and moe_layer were
run at b799bb0, ep_multi_gpu at 7098dcd; 0f58815 holds both and is the code of the later ``perfplan/*_base``
runs). The model predicts this code; a bench point of other code does not test it (``holdout``)."""


def measured_code(commit: str = MEASURED_CODE) -> dict:
    """{commit, moerl_digest} of the measured code (``freeze.moerl_digest`` of its moerl tree at
    ``commit``; None without the git history)."""
    try:
        digest = freeze.moerl_digest(freeze.commit_files(commit))
    except (OSError, subprocess.SubprocessError):
        digest = None
    return {"commit": commit, "moerl_digest": digest}


def constants(cal: dict) -> timing.Constants:
    """``timing.Constants`` from a calibration record."""
    return timing.Constants(**cal["constants"])


def write(cal: dict, path: Path) -> None:
    """Write the record atomically (others read it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m moerl.plan.calibrate``: fit, freeze (``freeze.freeze_record``: date, commit, model digest;
    a refit is a new model, so every point measured before it counts as seen), write ``calibration.json``,
    print the constants and the fit's notes."""
    parser = argparse.ArgumentParser(description="fit moerl.plan's constants on bench/results")
    parser.add_argument("--results", default=str(RESULTS), help=f"bench results folder (default: {RESULTS})")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if not Path(args.results).is_dir():
        parser.error(f"--results {args.results}: not a folder (bench/results of a moerl checkout)")
    cal = fit(Path(args.results))
    cal = {"freeze": freeze.freeze_record(cal), **cal}
    write(cal, Path(args.out))
    for note in cal["notes"]:
        print(f"note: {note}")
    print(json.dumps(cal["constants"], indent=2), json.dumps(cal["ep_impls"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
