"""Predictions of the planner against bench/results: one row per measured point.

``compare(cal, folder)`` returns one row per point: quantity, unit, measured, predicted, relative error,
``fitted`` (the point was used by ``calibrate.fit``), ``date`` (when the point was measured, ISO 8601 from
its bench file) and ``source`` (the file). Which rows count as held out is decided by the protocol in
``moerl.plan.holdout`` from these fields and the calibration's freeze, not here.

The points come from the files the fit read (``calibrate`` module docstring) and from every
``plan_holdout_*.json`` of the folder (``bench/plan_holdout_gpu.py``: dated runs taken after a freeze, read
by ``holdout_rows``).
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

HOLDOUT_GLOB = "plan_holdout_*.json"
"""Files of dated runs taken after a freeze (``bench/plan_holdout_gpu.py``), read from the results folder."""


def _row(
    name: str, measured: float, predicted: float, fitted: bool, unit: str, date: str, source: str
) -> dict:
    return {"quantity": name, "unit": unit, "measured": measured, "predicted": predicted,
            "rel_err": predicted / measured - 1.0, "fitted": fitted, "date": date, "source": source}  # fmt: skip


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


def compare(cal: dict, folder: Path, holdout_files: list[Path] | None = None) -> list[dict]:
    """All rows (module docstring): the fit's files in ``folder``, then ``holdout_files`` (default: every
    ``HOLDOUT_GLOB`` file of ``folder``, sorted). Raises FileNotFoundError naming a missing bench file and
    ValueError for a hold-out file that is not in ``holdout_rows``'s format."""
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
        pred = 1e3 * moerl_round_trip_s(cal, q["method"], q["work_bytes"])
        name = f"EP dispatch+combine ms, {q['method']} {q['topology']} H={q['hidden']} {q['routing']}"
        rows.append(
            _row(name, q["total_ms"], pred, q["topology"] == "2x1", "ms", ep["date"], "ep_multi_gpu.json")
        )
    t_ep1 = next(r["predicted"] for r in rows if r["quantity"].startswith("train step s, ep-bench EP=1"))
    rows += _ep2_training(cal, c, ep, MODELS["ep-bench"], t_ep1)
    rows += _ep2_decode(cal, c, ep, MODELS["ep-bench"], 128, 128)
    rows += _ep_smoke(cal, read("ep_smoke"))
    for path in sorted(folder.glob(HOLDOUT_GLOB)) if holdout_files is None else holdout_files:
        rows += holdout_rows(cal, json.loads(Path(path).read_text()), Path(path).name)
    return rows


def predict_decode_tok_s(c: timing.Constants, model, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Graph-mode decode throughput (tok/s) of ``batch`` prompts of ``prompt_len`` tokens each generating
    ``new_tokens`` on one H200, all prefilled in one step (``bench/rollout_gpu.py``'s setting)."""
    step = timing.decode_step_s(model, H200, c, batch, prompt_len + new_tokens / 2, 1, 2)
    gen = timing.prefill_s(model, H200, c, batch * prompt_len, prompt_len, 2) + (new_tokens - 1) * step
    return batch * new_tokens / gen


def predict_train_step_s(c: timing.Constants, model, batch: int, seq_len: int) -> float:
    """One-GPU training step (s) of ``batch`` sequences of ``seq_len`` tokens: FLOPs + optimizer pass."""
    return timing.train_compute_s(model, H200, c, batch * seq_len, seq_len) + timing.optimizer_s(
        H200, c, model.num_params
    )


def predict_moe_ms(c: timing.Constants, flops_fwd: float, backward: bool) -> float:
    """MoE layer time (ms) of ``flops_fwd`` forward FLOPs; with ``backward`` forward + backward (3x)."""
    return (3e3 if backward else 1e3) * flops_fwd / (c.moe_matmul_fraction * H200.bf16_tflops * 1e12)


def _decode(c: timing.Constants, roll: dict, ep: dict, held: dict | None = None) -> list[dict]:
    """The two CUDA-graph decode runs (both fitted) and the later ones of the same code
    (``decode_points``): prefill + (N - 1) decode steps."""
    p, n = roll["prompt_len"], roll["new_tokens"]
    points = [
        (MODELS["reference"], roll["batch"], roll["results"]["moerl"]["tokens_per_s"], True, "", roll["date"], "rollout_gpu.json"),
        (MODELS["ep-bench"], 64, ep["model"]["decode"]["ep1_graphs"]["tokens_per_s"], True, "", ep["date"], "ep_multi_gpu.json"),
    ]  # fmt: skip
    if held is not None:
        points += [(MODELS[held["spec"]], q["batch"], q["tokens_per_s"], False, ", issue-10 code", held["date"],
                    "perfplan/decode_points_base.json") for q in held["points"]]  # fmt: skip
    out = []
    for model, rows, measured, fitted, tag, date, src in points:
        name = f"decode tok/s, {model.name} {model.num_layers} layers B={rows} {p}+{n} (graphs{tag})"
        out.append(
            _row(name, measured, predict_decode_tok_s(c, model, rows, p, n), fitted, "tok/s", date, src)
        )
    return out


def _training(c: timing.Constants, train: dict, ep: dict) -> list[dict]:
    """train_step.json batches 8 and 24 (fitted), 16 (not fitted); the EP bench model at EP = 1."""
    ref, seq, out = MODELS["reference"], train["seq_len"], []
    for batch in (8, 16, 24):
        measured = train["results"][f"moerl/b{batch}"]["median_step_s"]
        out.append(_row(f"train step s, reference b{batch} x {seq}", measured, predict_train_step_s(c, ref, batch, seq),
                        batch != 16, "s", train["date"], "train_step.json"))  # fmt: skip
    t = predict_train_step_s(c, MODELS["ep-bench"], 8, 1024)
    measured = ep["model"]["train"]["ep1"]["step_ms"] / 1e3
    out.append(
        _row("train step s, ep-bench EP=1 8 x 1024", measured, t, False, "s", ep["date"], "ep_multi_gpu.json")
    )
    return out


def _moe(c: timing.Constants, moe: dict) -> list[dict]:
    """moe_layer.json: forward fitted, forward + backward (3x the FLOPs) not."""
    res, d, src = moe["results"]["moerl"], moe["date"], "moe_layer.json"
    return [_row("MoE layer fwd ms, 16384 tokens", res["fwd"]["median_ms"], predict_moe_ms(c, moe["flops_fwd"], False), True, "ms", d, src),
            _row("MoE layer fwd+bwd ms, 16384 tokens", res["fwd_bwd"]["median_ms"], predict_moe_ms(c, moe["flops_fwd"], True), False, "ms", d, src)]  # fmt: skip


def _ep_smoke(cal: dict, smoke: dict) -> list[dict]:
    """ep_smoke.json: both dispatchers at EP world size 1 (no peer), outside the 2-GPU regime fitted."""
    placement = ExpertPlacement(smoke["experts"], Topology(1, 1))
    rows, out = RowBytes(2 * smoke["hidden"], smoke["top_k"]), []
    for method, key in (("alltoall", "AllToAllDispatcher"), ("hierarchical", "HierarchicalDispatcher")):
        pred = 1e3 * moerl_round_trip_s(
            cal, method, expected_work_bytes(method, placement, smoke["tokens"], rows)
        )
        name = f"EP dispatch+combine ms, {method} world size 1 (1 GPU, no peer)"
        measured = smoke["results"][key]["dispatch_combine_ms"]
        out.append(_row(name, measured, pred, False, "ms", smoke["date"], "ep_smoke.json"))
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
                False,
                "s",
                ep["date"],
                "ep_multi_gpu.json",
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
        measured = ep["model"]["decode"][method]["tokens_per_s"]
        out.append(_row(name, measured, 2 * 64 * n / gen, False, "tok/s", ep["date"], "ep_multi_gpu.json"))
    return out


HOLDOUT_KINDS = {
    "decode": ("spec", "batch", "prompt_len", "new_tokens", "tokens_per_s"),
    "train_step": ("spec", "batch", "seq_len", "median_step_s"),
    "moe_layer": ("spec", "tokens", "fwd_ms", "fwd_bwd_ms"),
}
"""Fields of each kind of point in a ``plan_holdout_*.json`` file (``bench/plan_holdout_gpu.py``)."""


def moe_flops_fwd(model, tokens: int) -> float:
    """Forward FLOPs of one MoE block of ``model`` on ``tokens`` tokens: 2 T (H E router + k 3 H I experts)."""
    return 2.0 * tokens * (model.hidden_size * model.num_experts + model.top_k * model.expert_params)


def holdout_rows(cal: dict, payload: dict, source: str) -> list[dict]:
    """The rows of one hold-out file: each point predicted by the model of ``cal``. Every row also carries
    the file's ``freeze`` (the calibration freeze it was taken against), ``code_digest`` (``freeze.
    moerl_digest`` of the moerl code it timed) and ``dry_run``; ``fitted`` is False.

    Payload: {benchmark: "plan_holdout", date (ISO 8601 with zone), freeze, code: {moerl_digest, ...},
    dry_run, points: [{kind, ...}]} with the fields of ``HOLDOUT_KINDS`` per kind (times in s or ms as named, batch
    and lengths in sequences and tokens, spec a ``moerl.plan.models.MODELS`` name).

    Raises:
        ValueError: not a plan_holdout payload, a point of unknown kind, a missing field or unknown spec
            (one line naming ``source`` and the point).
    """
    if payload.get("benchmark") != "plan_holdout" or not isinstance(payload.get("points"), list):
        raise ValueError(
            f"{source}: not a plan_holdout file (benchmark 'plan_holdout' with a list of points)"
        )
    for key in ("date", "freeze"):
        if key not in payload:
            raise ValueError(f"{source}: no {key!r}")
    c, out = constants(cal), []
    extra = {"freeze": payload["freeze"], "code_digest": (payload.get("code") or {}).get("moerl_digest"),
             "dry_run": bool(payload.get("dry_run"))}  # fmt: skip
    for i, q in enumerate(payload["points"]):
        kind = q.get("kind")
        missing = [f for f in HOLDOUT_KINDS.get(kind, ()) if f not in q]
        if kind not in HOLDOUT_KINDS or missing:
            why = f"unknown kind {kind!r}" if kind not in HOLDOUT_KINDS else f"missing {', '.join(missing)}"
            raise ValueError(f"{source}: point {i}: {why} (kinds: {', '.join(HOLDOUT_KINDS)})")
        if q["spec"] not in MODELS:
            raise ValueError(f"{source}: point {i}: unknown spec {q['spec']!r}")
        m, d = MODELS[q["spec"]], payload["date"]
        if kind == "decode":
            name = f"decode tok/s, {m.name} {m.num_layers} layers B={q['batch']} {q['prompt_len']}+{q['new_tokens']} (graphs)"
            pred = predict_decode_tok_s(c, m, q["batch"], q["prompt_len"], q["new_tokens"])
            rows = [_row(name, q["tokens_per_s"], pred, False, "tok/s", d, source)]
        elif kind == "train_step":
            pred = predict_train_step_s(c, m, q["batch"], q["seq_len"])
            name = f"train step s, {m.name} b{q['batch']} x {q['seq_len']}"
            rows = [_row(name, q["median_step_s"], pred, False, "s", d, source)]
        else:
            flops = moe_flops_fwd(m, q["tokens"])
            rows = [_row(f"MoE layer {tag} ms, {q['tokens']} tokens ({m.name})", q[f"{tag.replace('+', '_')}_ms"],
                         predict_moe_ms(c, flops, tag == "fwd+bwd"), False, "ms", d, source)
                    for tag in ("fwd", "fwd+bwd")]  # fmt: skip
        out += [{**r, **extra} for r in rows]
    return out
