"""Predictions of the planner against bench/results: the fitted points (in-sample) and the held-out ones.

``compare(cal, folder)`` returns one row per point: quantity, measured, predicted, relative error, and
whether the point was used for fitting (``calibrate`` module docstring lists which).
"""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

from moerl.ep import ExpertPlacement, Topology
from moerl.plan import timing
from moerl.plan.calibrate import H200, constants
from moerl.plan.models import MODELS
from moerl.plan.traffic import RowBytes


def _row(name: str, measured: float, predicted: float, role: str, unit: str) -> dict:
    return {"quantity": name, "unit": unit, "measured": measured, "predicted": predicted,
            "rel_err": predicted / measured - 1.0, "role": role}  # fmt: skip


def moerl_round_trip_s(cal: dict, method: str, work_bytes: float, *, decode: bool = False) -> float:
    """Fitted round trip (dispatch + combine) of moerl's dispatcher ``method`` over ``work_bytes``; with
    ``decode`` the fixed cost is the one measured at decode token counts (``decode_call_s``) if calibrated."""
    imp = cal["ep_impls"][method]
    call = imp.get("decode_call_s", imp["call_s"]) if decode else imp["call_s"]
    return call + work_bytes / (imp["proc_gb_s"] * 1e9)


def expected_work_bytes(method: str, placement: ExpertPlacement, tokens: float, rows: RowBytes) -> float:
    """Work bytes of one round trip on a rank (as ``calibrate.dispatch_points`` counts them), expected under
    uniform routing: flat 2 T k (row_d + row_c); hierarchical 2 T sum_d P(needs d) (row_h + row_c) + 4 T k H."""
    k = rows.top_k
    if method == "alltoall":
        return 2 * tokens * k * (rows.flat_dispatch + rows.combine)
    e, r = placement.num_experts, placement.topology.world_size
    p_rank = 1 - _comb_ratio(e - e // r, e, k)
    return 2 * tokens * r * p_rank * (rows.hier_dispatch + rows.combine) + tokens * k * 2 * rows.hidden


def _comb_ratio(a: int, b: int, k: int) -> float:
    return comb(a, k) / comb(b, k)


def compare(cal: dict, folder: Path) -> list[dict]:
    """All rows (module docstring)."""
    c = constants(cal)
    read = lambda n: json.loads((folder / f"{n}.json").read_text())  # noqa: E731
    ep = read("ep_multi_gpu")
    held = folder / "perfplan" / "decode_points_base.json"
    rows = (
        _decode(c, read("rollout_gpu"), ep, json.loads(held.read_text()) if held.exists() else None)
        + _training(c, read("train_step"), ep)
        + _moe(c, read("moe_layer"))
    )
    for q in cal["dispatch_points"]:
        if q["method"] == "floor_a2a":
            continue
        role = "fitted" if q["topology"] == "2x1" else "held out"
        pred = 1e3 * moerl_round_trip_s(cal, q["method"], q["work_bytes"])
        name = f"EP dispatch+combine ms, {q['method']} {q['topology']} H={q['hidden']} {q['routing']}"
        rows.append(_row(name, q["total_ms"], pred, role, "ms"))
    t_ep1 = next(r["predicted"] for r in rows if r["quantity"].startswith("train step s, ep-bench EP=1"))
    rows += _ep2_training(cal, c, ep, MODELS["ep-bench"], t_ep1)
    rows += _ep2_decode(cal, c, ep, MODELS["ep-bench"], 128, 128)
    rows += _ep_smoke(cal, read("ep_smoke"))
    return rows


def _decode(c: timing.Constants, roll: dict, ep: dict, held: dict | None = None) -> list[dict]:
    """The two CUDA-graph decode runs (both fitted) and the held-out ones of the same code
    (``decode_points``): prefill + (N - 1) decode steps."""
    b, p, n = roll["batch"], roll["prompt_len"], roll["new_tokens"]
    points = [
        (MODELS["reference"], b, roll["results"]["moerl"]["tokens_per_s"], "fitted", ""),
        (MODELS["ep-bench"], 64, ep["model"]["decode"]["ep1_graphs"]["tokens_per_s"], "fitted", ""),
    ]
    if held is not None:
        points += [(MODELS[held["spec"]], q["batch"], q["tokens_per_s"], "held out", ", issue-10 code")
                   for q in held["points"]]  # fmt: skip
    out = []
    for model, rows, measured, role, tag in points:
        step = timing.decode_step_s(model, H200, c, rows, p + n / 2, 1, 2)
        gen = timing.prefill_s(model, H200, c, rows * p, p, 2) + (n - 1) * step
        name = f"decode tok/s, {model.name} {model.num_layers} layers B={rows} {p}+{n} (graphs{tag})"
        out.append(_row(name, measured, rows * n / gen, role, "tok/s"))
    return out


def _training(c: timing.Constants, train: dict, ep: dict) -> list[dict]:
    """train_step.json batches 8 and 24 (fitted), 16 (held out); the EP bench model at EP = 1 (held out)."""
    ref, epm, seq, out = MODELS["reference"], MODELS["ep-bench"], train["seq_len"], []
    for batch in (8, 16, 24):
        t = timing.train_compute_s(ref, H200, c, batch * seq, seq) + timing.optimizer_s(
            H200, c, ref.num_params
        )
        measured = train["results"][f"moerl/b{batch}"]["median_step_s"]
        out.append(
            _row(
                f"train step s, reference b{batch} x {seq}",
                measured,
                t,
                "held out" if batch == 16 else "fitted",
                "s",
            )
        )
    t = timing.train_compute_s(epm, H200, c, 8 * 1024, 1024) + timing.optimizer_s(H200, c, epm.num_params)
    out.append(
        _row(
            "train step s, ep-bench EP=1 8 x 1024",
            ep["model"]["train"]["ep1"]["step_ms"] / 1e3,
            t,
            "held out",
            "s",
        )
    )
    return out


def _moe(c: timing.Constants, moe: dict) -> list[dict]:
    """moe_layer.json: forward fitted, forward + backward (3x the FLOPs) held out."""
    fwd = moe["flops_fwd"] / (c.moe_matmul_fraction * H200.bf16_tflops * 1e12)
    res = moe["results"]["moerl"]
    return [_row("MoE layer fwd ms, 16384 tokens", res["fwd"]["median_ms"], 1e3 * fwd, "fitted", "ms"),
            _row("MoE layer fwd+bwd ms, 16384 tokens", res["fwd_bwd"]["median_ms"], 3e3 * fwd, "held out", "ms")]  # fmt: skip


def _ep_smoke(cal: dict, smoke: dict) -> list[dict]:
    """ep_smoke.json: both dispatchers at EP world size 1 (no peer), outside the 2-GPU regime fitted."""
    placement = ExpertPlacement(smoke["experts"], Topology(1, 1))
    rows, out = RowBytes(2 * smoke["hidden"], smoke["top_k"]), []
    for method, key in (("alltoall", "AllToAllDispatcher"), ("hierarchical", "HierarchicalDispatcher")):
        pred = 1e3 * moerl_round_trip_s(
            cal, method, expected_work_bytes(method, placement, smoke["tokens"], rows)
        )
        name = f"EP dispatch+combine ms, {method} world size 1 (1 GPU, no peer)"
        out.append(_row(name, smoke["results"][key]["dispatch_combine_ms"], pred, "held out", "ms"))
    return out


def _ep2_training(cal: dict, c: timing.Constants, ep: dict, epm, t_ep1: float) -> list[dict]:
    """EP = 2 training step: the EP = 1 step with half the experts' optimizer work, plus 2 round trips per
    MoE layer at 8192 tokens per GPU and the all-reduce of the replicated (non-expert) gradients."""
    topo = Topology(2, 2)
    placement, rb = ExpertPlacement(epm.num_experts, topo), RowBytes(2 * epm.hidden_size, epm.top_k)
    opt_saved = timing.optimizer_s(H200, c, epm.routed_expert_params / 2)
    reduce = timing.allreduce_s(
        2 * epm.non_expert_params, 2, H200.nvlink_gb_s, cal["nvlink_fraction_all_to_all"]
    )
    out = []
    for method in ("alltoall", "hierarchical"):
        rt = moerl_round_trip_s(cal, method, expected_work_bytes(method, placement, 8192, rb))
        pred = t_ep1 - opt_saved + 2 * epm.num_moe_layers * rt + reduce
        out.append(
            _row(
                f"train step s, ep-bench EP=2 {method}",
                ep["model"]["train"][method]["step_ms"] / 1e3,
                pred,
                "held out",
                "s",
            )
        )
    return out


def _ep2_decode(cal: dict, c: timing.Constants, ep: dict, epm, p: int, n: int) -> list[dict]:
    """EP = 2 eager decode, 64 requests per GPU: eager step + what a round trip adds per MoE layer. The eager
    step is max(host, device): the host's is the EP = 1 eager step (same kernels), the device's the EP = 2
    roofline (half the experts per GPU). Each dispatch blocks the host on split sizes, so the round trip's
    cost adds to the step rather than overlapping it: with ``eager_decode`` calibrated, the dispatcher's in-context cost per
    MoE layer measured at EP world size 1 (``decode_layer_w1_s``) times ``host_scale`` (the EP bench
    machine's host against the w1 machine's, from their own non-EP eager runs); otherwise the per-call cost
    at decode sizes (``decode_call_s``) plus the work bytes at the fitted rate."""
    placement, rb = ExpertPlacement(epm.num_experts, Topology(2, 2)), RowBytes(2 * epm.hidden_size, epm.top_k)
    device = timing.decode_step_s(epm, H200, c, 64, p + n / 2, 2, 2)
    # The eager step launches the same kernels at EP 1 and 2 and is host-bound (eager_layer_s ~3.8 ms per
    # layer against ~1 ms of device work), so halving the experts' bytes does not shorten it: the host's
    # step is the EP = 1 eager step (graph step + eager_layer_s per layer), the device's the EP = 2 roofline.
    host = timing.decode_step_s(epm, H200, c, 64, p + n / 2, 1, 2) + epm.num_layers * c.eager_layer_s
    step = max(host, device)
    eager = cal.get("eager_decode")
    out = []
    for method in ("alltoall", "hierarchical"):
        if eager is not None:
            rt = eager["host_scale"] * eager["decode_layer_w1_s"][method]
        else:
            work = expected_work_bytes(method, placement, 64, rb)
            rt = moerl_round_trip_s(cal, method, work, decode=True)
        gen = timing.prefill_s(epm, H200, c, 64 * p, p, 2) + (n - 1) * (step + epm.num_moe_layers * rt)
        name = f"decode tok/s, ep-bench EP=2 {method} (eager)"
        out.append(
            _row(name, ep["model"]["decode"][method]["tokens_per_s"], 2 * 64 * n / gen, "held out", "tok/s")
        )
    return out
