"""One-at-a-time sensitivity of the hierarchical / flat rollout throughput ratio (a tornado table).

Each assumption is moved to a low and a high value with every other input at the plan's value; the rows
are sorted by how far they move the ratio. The ranges are judgement calls, listed here so they can be
argued with: ``--set`` and ``--sweep`` reach every plan one of them.

The calibrated values (``calibration.json``: every fitted fraction, fixed cost and dispatcher rate) are
rows too (``calibrated.*``), each moved over ``CALIBRATED_SPAN`` times its fitted value (fractions capped at
``FRACTION_CAP``); to run a whole plan at another value, edit a copy of the calibration and pass it with
``--calibration``.
"""

from __future__ import annotations

import copy

from moerl.configlib import ConfigError
from moerl.plan.predict import Plan, run, set_param

RANGES: list[tuple[str, str, str, str]] = [
    ("top_k", "1", "4", "experts per token (the mission's sweep; the model's own is 8)"),
    ("placement", "grouped", "round_robin", "expert placement"),
    ("rollout_ep_nodes", "1", "4", "nodes one rollout replica's EP group spans"),
    ("rollout_rows_per_gpu", "32", "256", "concurrent sequences per GPU in decode"),
    ("net_fraction", "0.5", "0.95", "achieved fraction of EFA bandwidth (both dispatchers)"),
    ("flat_net_fraction", "0.4", "0.95", "achieved EFA fraction of the flat all-to-all alone"),
    ("flat_message_factor", "1", "4", "per-message cost of NCCL all-to-all relative to the RDMA writes"),
    ("kernel_call_us", "10", "200", "fixed cost per dispatch or combine call"),
    ("ep_overlap", "0", "0.7", "EP time hidden behind compute (two-micro-batch overlap)"),
    ("dispatch_bytes", "1", "2", "bytes per hidden element on the wire (FP8 dispatch = 1)"),
    ("weight_bytes", "1", "2", "rollout weight/KV bytes per element (FP8 = 1)"),
    ("response_len", "1024", "16384", "mean response tokens"),
    ("ep_impl", "kernel", "moerl", "dispatcher implementation: fused kernels or moerl.ep today (fitted)"),
]


CALIBRATED_SPAN: dict[str, tuple[float, float, str]] = {
    "fraction": (0.5, 2.0, "fitted fraction of a datasheet peak; half to twice moerl's"),
    "gb_s": (0.5, 4.0, "fitted dispatcher work rate, GB/s; half to 4x moerl's (ep_impl=moerl only)"),
    "s": (0.1, 2.0, "fitted fixed cost, s; a tenth (fused, graph-captured) to twice moerl's"),
}
"""Span of each kind of calibrated value, by the ending of its name (first match): (low factor, high
factor, meaning)."""
FRACTION_CAP = 0.95
"""No fraction of a peak above this (a fitted 0.41 at 2x is 0.83; 0.6 at 2x would be 0.95)."""


def calibrated_ranges(cal: dict) -> list[tuple[tuple[str, ...], float, float, str]]:
    """(key path in ``cal``, low, high, meaning) of every calibrated value: ``constants`` and each
    dispatcher's ``call_s``, ``decode_call_s`` and ``proc_gb_s`` in ``ep_impls``."""
    paths = [("constants", k) for k in cal["constants"]]
    paths += [("ep_impls", m, k) for m, imp in cal["ep_impls"].items() for k in imp]
    out = []
    for path in paths:
        kind = next(k for k in CALIBRATED_SPAN if path[-1].endswith(k))
        lo_f, hi_f, what = CALIBRATED_SPAN[kind]
        v = _get(cal, path)
        hi = min(v * hi_f, FRACTION_CAP) if kind == "fraction" else v * hi_f
        where = " (ep_impl=moerl only)" if path[0] == "ep_impls" and kind == "s" else ""
        out.append((path, v * lo_f, hi, f"{what}{where} ({v:.3g})"))
    return out


def _get(cal: dict, path: tuple[str, ...]) -> float:
    for k in path:
        cal = cal[k]
    return cal


def _with(cal: dict, path: tuple[str, ...], value: float) -> dict:
    out = copy.deepcopy(cal)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def tornado(plan: Plan, cal: dict) -> list[dict]:
    """Rows {param, what, low, high, ratio_low, ratio_high, swing, base}, largest swing first: the plan's
    ``RANGES`` and every calibrated value (``calibrated_ranges``; param ``calibrated.<key path>``).

    A value that makes the plan invalid (e.g. EP over 1 node for a model that does not fit) gives None.
    """
    base = _ratio(plan, cal)
    rows = []
    for path, lo, hi, what in calibrated_ranges(cal):
        r_lo, r_hi = (_ratio(plan, _with(cal, path, v)) for v in (lo, hi))
        swing = max(abs(r - base) for r in (r_lo, r_hi))
        rows.append({"param": "calibrated." + ".".join(path[1:] if path[0] == "constants" else path), "what": what,
                     "low": f"{lo:.3g}", "high": f"{hi:.3g}", "ratio_low": r_lo, "ratio_high": r_hi,
                     "swing": swing, "base": base})  # fmt: skip
    for name, lo, hi, what in RANGES:
        r_lo, r_hi = (_ratio_or_none(plan, name, v, cal) for v in (lo, hi))
        swing = max(abs((r or base) - base) for r in (r_lo, r_hi))
        rows.append({"param": name, "what": what, "low": lo, "high": hi, "ratio_low": r_lo, "ratio_high": r_hi,
                     "swing": swing, "base": base})  # fmt: skip
    return sorted(rows, key=lambda r: -r["swing"])


def _ratio(plan: Plan, cal: dict) -> float:
    flat, hier = run(plan, cal)
    return hier.rollout_tok_s / flat.rollout_tok_s


def _ratio_or_none(plan: Plan, name: str, value: str, cal: dict) -> float | None:
    try:  # the value may be outside the plan's ranges (rollout_ep_nodes=4 for 6 rollout nodes) or not fit
        return _ratio(set_param(plan, name, value), cal)
    except ConfigError:
        return None
