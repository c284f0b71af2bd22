"""``moerl plan --schedules``: the seed's question under every weight transport and schedule.

For a plan (the mission preset by default): the hierarchical / flat ratio of useful episodes per second
(end to end: generation, training and weight sync under the schedule, not rollout tokens alone) and the $
per 1000 useful episodes of each dispatcher, for each (schedule, transport) pair the plan admits
(``cuda_ipc`` only colocated, the others only apart); then how far each calibrated value moves that ratio
under each schedule (its default transport): every ``calibration.json`` fitted value
(``sensitivity.calibrated_ranges``: half to twice a fraction, a tenth to twice a fixed cost, half to 4x a
rate) and each of moerl's weight-sync measurements (``weight_sync``, the same spans by unit).
"""

from __future__ import annotations

from dataclasses import replace

from moerl.configlib import ConfigError
from moerl.plan.inputs import Plan
from moerl.plan.predict import run
from moerl.plan.schedules import SCHEDULES
from moerl.plan.sensitivity import CALIBRATED_SPAN, FRACTION_CAP, _get, _with, calibrated_ranges
from moerl.plan.transports import LOCAL_TRANSPORTS, TRANSPORTS

DEFAULT_TRANSPORT = {"colocated": "cuda_ipc", "sync": "nccl_broadcast", "one_step_off": "nccl_broadcast",
                     "fully_async": "sharded_p2p"}  # fmt: skip
"""Transport of each schedule in the sensitivity table: what the published runs of that schedule use."""


def pairs() -> list[tuple[str, str]]:
    """Every (schedule, transport) a plan admits (``Plan``: a local transport only colocated)."""
    return [(s, t) for s in SCHEDULES for t in TRANSPORTS if (t in LOCAL_TRANSPORTS) == (s == "colocated")]


def _point(plan: Plan, cal: dict) -> dict:
    flat, hier = run(plan, cal)
    return {"ratio": hier.useful_episodes_s / flat.useful_episodes_s, "step_flat_s": flat.step_s,
            "step_hier_s": hier.step_s, "usd_flat": flat.usd_per_1000_episodes,
            "usd_hier": hier.usd_per_1000_episodes, "weight_sync_s": hier.weight_sync_s}  # fmt: skip


def schedule_matrix(plan: Plan, cal: dict) -> list[dict]:
    """Rows {schedule, transport, ratio, step_flat_s, step_hier_s, usd_flat, usd_hier, weight_sync_s} of
    every pair (``pairs``); a pair the plan cannot run (it does not fit) has ``error`` instead."""
    rows = []
    for schedule, transport in pairs():
        try:
            point = _point(replace(plan, schedule=schedule, weight_transport=transport), cal)
        except ConfigError as e:
            point = {"error": str(e)}
        rows.append({"schedule": schedule, "transport": transport, **point})
    return rows


def sync_ranges(cal: dict) -> list[tuple[tuple[str, ...], float, float, str]]:
    """(key path, low, high, meaning) of each weight-sync measurement, spans as ``CALIBRATED_SPAN``."""
    out = []
    for k, v in cal["weight_sync"]["constants"].items():
        kind = next(x for x in CALIBRATED_SPAN if k.endswith(x))
        lo_f, hi_f, what = CALIBRATED_SPAN[kind]
        hi = min(v * hi_f, FRACTION_CAP) if kind == "fraction" else v * hi_f
        out.append((("weight_sync", "constants", k), v * lo_f, hi, f"{what} ({v:.3g}, weight-sync bench)"))
    return out


def ratio_sensitivity(plan: Plan, cal: dict) -> list[dict]:
    """Rows {param, low, high, by_schedule: {schedule: (ratio at low, ratio at high)}, swing}, largest swing
    first, for every calibrated value (module docstring); a ratio the plan cannot give is None."""
    plans = {s: replace(plan, schedule=s, weight_transport=DEFAULT_TRANSPORT[s]) for s in SCHEDULES}
    base = {s: _ratio(p, cal) for s, p in plans.items()}
    rows = []
    for path, lo, hi, _what in calibrated_ranges(cal) + sync_ranges(cal):
        by = {s: tuple(_ratio(p, _with(cal, path, v)) for v in (lo, hi)) for s, p in plans.items()}
        moved = [
            abs(r - base[s]) for s, rs in by.items() for r in rs if r is not None and base[s] is not None
        ]
        swing = max(moved, default=0.0)
        name = ".".join(path[1:] if path[0] == "constants" else path)
        rows.append({"param": name, "low": lo, "high": hi, "value": _get(cal, path), "by_schedule": by,
                     "swing": swing, "base": base})  # fmt: skip
    return sorted(rows, key=lambda r: -r["swing"])


def _ratio(plan: Plan, cal: dict) -> float | None:
    try:
        return _point(plan, cal)["ratio"]
    except ConfigError:
        return None
