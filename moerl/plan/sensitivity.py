"""One-at-a-time sensitivity of the hierarchical / flat rollout throughput ratio (a tornado table).

Each assumption is moved to a low and a high value with every other input at the plan's value; the rows
are sorted by how far they move the ratio. The ranges are judgement calls, listed here so they can be
argued with: ``--set`` and ``--sweep`` reach every one of them.
"""

from __future__ import annotations

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


def tornado(plan: Plan, cal: dict) -> list[dict]:
    """Rows {param, what, low, high, ratio_low, ratio_high, swing}, largest swing first.

    A value that makes the plan invalid (e.g. EP over 1 node for a model that does not fit) gives None.
    """
    base = _ratio(plan, cal)
    rows = []
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
