"""Prometheus alert rules over the exporter's series (``moerl.telemetry.prometheus.SERIES``), rendered
from documented thresholds. ``deploy/prometheus/rules.yaml`` is ``render_rules(AlertParams())``; a test
checks that the committed file equals it, and ``deploy/prometheus/rules_test.yaml`` holds promtool unit
tests with synthetic series for every alert. Regenerate with other thresholds:

    python3 -m moerl.telemetry.alerts --set spread=0.3 --set spot_notices=5 > rules.yaml

The alerts (one rule group ``moerl``):

    MoerlWorkerRateDrop      a worker's token rate over ``rate_window`` is more than ``rate_drop`` below
                             its own rate over the ``baseline_window`` before it, for ``rate_drop_for``
    MoerlWorkerRateSpread    a worker's rate is more than ``spread`` below the fastest worker's, for
                             ``spread_for`` (fires per laggard; present iff (max - min) / max > spread)
    MoerlBufferBacklog       the buffer's lowest depth over ``backlog_window`` rose above the window's
                             before it, or it never had room (lowest depth at capacity), for
                             ``backlog_for``: producers outpace the trainer
    MoerlTrainerStarved      the trainer waits for batches more than ``starvation_wait_frac`` of wall
                             time over ``starvation_window``, for ``starvation_for``
    MoerlCommErrors          any communication error (collective timeout, transport, RPC, provider) within
                             ``comm_error_window``; fires at once
    MoerlSpotNoticeBurst     at least ``spot_notices`` termination notices over all workers within
                             ``spot_window``: clustered preemptions
    MoerlTokensDiscarded     generated tokens thrown away (``rollout/tokens_discarded``: hard losses less
                             their progress snapshots, drains without prefixes, aborts) per hour of
                             rollout (per live worker) over ``discarded_window`` above
                             ``discarded_tokens_per_hour``: work is being redone
    MoerlStalenessAtLimit    a live worker's policy lag is at ``runtime.max_staleness`` (and > 0) for
                             ``staleness_for``: it keeps generating at the staleness limit

Only live workers (``moerl_worker_up == 1``) count for the per-worker alerts. Every rate is over the
counters, so restarts of the driver (counters reset) are handled by ``rate``/``increase``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass

import yaml

from moerl.configlib import ConfigError, apply_overrides, check_range, from_dict

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")

TOKENS = "moerl_rollout_tokens_total"
UP = "moerl_worker_up == 1"


@dataclass(kw_only=True, slots=True, frozen=True)
class AlertParams:
    """Thresholds and windows of the alert rules (durations in Prometheus syntax: ``30s``, ``5m``, ``1h``)."""

    rate_window: str = "5m"
    """Window of the current per-worker token rate (``rate(moerl_rollout_tokens_total[...])``)."""
    baseline_window: str = "30m"
    """Window of a worker's own baseline rate, ending where ``rate_window`` begins (``offset``)."""
    rate_drop: float = 0.2
    """Fraction below its baseline at which a worker's rate counts as dropped (0.2: 20%)."""
    rate_drop_for: str = "5m"
    """How long the drop must last before the alert fires."""
    spread: float = 0.2
    """Fraction below the fastest live worker's rate at which a worker counts as a laggard."""
    spread_for: str = "5m"
    """How long the spread must last."""
    backlog_window: str = "10m"
    """Window of ``min_over_time(moerl_buffer_depth_groups[...])`` (and the offset of the one before)."""
    backlog_for: str = "10m"
    """How long the buffer must keep growing (or stay full) before the alert fires."""
    starvation_wait_frac: float = 0.5
    """Fraction of wall time the trainer waits for batches above which it counts as starved."""
    starvation_window: str = "5m"
    """Window of ``rate(moerl_trainer_wait_seconds_total[...])``."""
    starvation_for: str = "5m"
    """How long the starvation must last."""
    comm_error_window: str = "5m"
    """Window of ``increase(moerl_comm_errors_total[...])``; the alert fires on any increase in it."""
    spot_notices: int = 3
    """Termination notices (all workers together) within ``spot_window`` that make a burst."""
    spot_window: str = "10m"
    """Window of the notice count."""
    staleness_for: str = "15m"
    """How long a worker's policy lag must stay at the staleness limit."""
    discarded_tokens_per_hour: int = 100_000
    """Discarded generated tokens per hour of one live worker's rollout above which the run redoes too
    much work (a hard loss with ``fleet.snapshot_tokens`` loses at most about that many tokens per
    sequence; without snapshots, every in-flight token: ~ slots x mean response length)."""
    discarded_window: str = "1h"
    """Window of ``rate(moerl_tokens_discarded_total[...])``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and not _DURATION.match(value):
                raise ConfigError(
                    f"alerts.{f.name}={value!r} is not a Prometheus duration (e.g. 30s, 5m, 1h)"
                )
        for name in ("rate_drop", "spread", "starvation_wait_frac"):
            check_range(f"alerts.{name}", getattr(self, name), 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("alerts.spot_notices", self.spot_notices, 1)
        check_range("alerts.discarded_tokens_per_hour", self.discarded_tokens_per_hour, 1)


def _rule(name: str, expr: str, duration: str, severity: str, summary: str, description: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def _live_rate(window: str) -> str:
    return f"(rate({TOKENS}[{window}]) and {UP})"


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def _worker_rules(p: AlertParams) -> list[dict]:
    """Rate drop and spread, per live worker."""
    drop, spread = round(1.0 - p.rate_drop, 6), round(1.0 - p.spread, 6)
    return [
        _rule(
            "MoerlWorkerRateDrop",
            f"{_live_rate(p.rate_window)} < {drop} * rate({TOKENS}[{p.baseline_window}] offset {p.rate_window})",
            p.rate_drop_for,
            "warning",
            "Rollout worker {{ $labels.worker }} is generating slower than its own baseline",
            f"Token rate over {p.rate_window} more than {_pct(p.rate_drop)} below the worker's rate over the "
            f"{p.baseline_window} before, for {p.rate_drop_for} (slow node, throttled GPU, noisy neighbour).",
        ),
        _rule(
            "MoerlWorkerRateSpread",
            f"{_live_rate(p.rate_window)} < ignoring(worker, node) group_left {spread} * "
            f"max without(worker, node) {_live_rate(p.rate_window)}",
            p.spread_for,
            "warning",
            "Rollout worker {{ $labels.worker }} lags the fastest worker",
            f"Token rate over {p.rate_window} more than {_pct(p.spread)} below the fastest live worker's, "
            f"for {p.spread_for}.",
        ),
    ]


def _run_rules(p: AlertParams) -> list[dict]:
    """Backlog, starvation, comm errors, notice bursts, discarded tokens, staleness."""
    # the backlog is the depth the buffer never drains below: robust to the step-by-step sawtooth
    low = f"min_over_time(moerl_buffer_depth_groups[{p.backlog_window}])"
    low_before = f"min_over_time(moerl_buffer_depth_groups[{p.backlog_window}] offset {p.backlog_window})"
    return [
        _rule(
            "MoerlBufferBacklog",
            f"{low} > {low_before} or ({low} >= moerl_buffer_capacity_groups and moerl_buffer_capacity_groups > 0)",
            p.backlog_for,
            "warning",
            "The experience buffer keeps filling: rollout outpaces the trainer",
            f"The buffer's lowest depth over {p.backlog_window} rose above the {p.backlog_window} before, or "
            f"it never had room, for {p.backlog_for}; "
            "workers block on backpressure and their groups age (fewer workers, or a faster trainer).",
        ),
        _rule(
            "MoerlTrainerStarved",
            f"rate(moerl_trainer_wait_seconds_total[{p.starvation_window}]) > {p.starvation_wait_frac}",
            p.starvation_for,
            "warning",
            "The trainer is waiting for batches",
            f"The trainer waited for the buffer more than {_pct(p.starvation_wait_frac)} of the time over "
            f"{p.starvation_window}, for {p.starvation_for} (too few rollout workers).",
        ),
        _rule(
            "MoerlCommErrors",
            f"increase(moerl_comm_errors_total[{p.comm_error_window}]) > 0",
            "0s",
            "critical",
            "Communication errors of kind {{ $labels.kind }}",
            f"Collective timeouts, transport errors (NCCL, gloo, libfabric, Ray) or provider errors within "
            f"{p.comm_error_window}.",
        ),
        _rule(
            "MoerlSpotNoticeBurst",
            f"sum without(worker, node) (increase(moerl_spot_notices_total[{p.spot_window}])) >= {p.spot_notices}",
            "0s",
            "warning",
            "Clustered spot preemptions",
            f"At least {p.spot_notices} termination notices within {p.spot_window}; expect requeues and lost work.",
        ),
        _rule(
            "MoerlTokensDiscarded",
            f"sum without(worker, node) (rate(moerl_tokens_discarded_total[{p.discarded_window}])) * 3600 / "
            f"clamp_min(count without(worker, node) ({UP}), 1) > {p.discarded_tokens_per_hour}",
            "0s",
            "warning",
            "Rollout work is being thrown away",
            f"More than {p.discarded_tokens_per_hour} generated tokens discarded per hour of rollout per live "
            f"worker over {p.discarded_window} (hard losses not covered by progress snapshots, drains or "
            "aborts); check fleet.snapshot_tokens and the interruption rate.",
        ),
        _rule(
            "MoerlStalenessAtLimit",
            "((moerl_worker_policy_lag > 0) >= ignoring(worker, node) group_left moerl_max_staleness) and "
            + UP,
            p.staleness_for,
            "warning",
            "Rollout worker {{ $labels.worker }} generates at the staleness limit",
            f"Its policy lag has been at runtime.max_staleness for {p.staleness_for}: weight sync is slow "
            "or the worker misses new versions, and its groups risk being refused as stale.",
        ),
    ]


def rule_groups(p: AlertParams) -> dict:
    """The rule file as a dict (``{"groups": [...]}``; also the ``spec`` of a ``PrometheusRule``)."""
    return {"groups": [{"name": "moerl", "rules": [*_worker_rules(p), *_run_rules(p)]}]}


HEADER = (
    "# Prometheus alert rules of moerl, generated by moerl.telemetry.alerts with its default thresholds.\n"
    "# Do not edit: regenerate with `python3 -m moerl.telemetry.alerts > deploy/prometheus/rules.yaml`\n"
    "# (--set NAME=VALUE for other thresholds). Unit tests: promtool test rules rules_test.yaml\n"
)
"""Header of the rule file rendered with the default thresholds (``deploy/prometheus/rules.yaml``)."""


def overridden(params: AlertParams) -> dict[str, tuple[object, object]]:
    """``{name: (value used, default)}`` of every threshold of ``params`` that differs from its default."""
    default = AlertParams()
    return {
        f.name: (getattr(params, f.name), getattr(default, f.name))
        for f in dataclasses.fields(AlertParams)
        if getattr(params, f.name) != getattr(default, f.name)
    }


def header(params: AlertParams) -> str:
    """The rule file's header comment: ``HEADER`` for the defaults; otherwise it names every threshold used
    that is not the default (with the default), and the command that regenerates this very file."""
    changed = overridden(params)
    if not changed:
        return HEADER
    sets = " ".join(f"--set {k}={v}" for k, (v, _) in changed.items())
    used = ", ".join(f"{k}={v} (default {d})" for k, (v, d) in changed.items())
    return (
        "# Prometheus alert rules of moerl, generated by moerl.telemetry.alerts with its default thresholds\n"
        f"# except: {used}.\n"
        f"# Do not edit: regenerate with `python3 -m moerl.telemetry.alerts {sets}`.\n"
        "# Unit tests (written for the defaults): promtool test rules rules_test.yaml\n"
    )


def render_rules(params: AlertParams | None = None) -> str:
    """The rule file's text (YAML with a header comment naming the thresholds used, ``header``)."""
    params = params or AlertParams()
    body = yaml.safe_dump(rule_groups(params), sort_keys=False, width=1000)
    return header(params) + body


def main(argv: list[str] | None = None) -> int:
    """``python3 -m moerl.telemetry.alerts [--set NAME=VALUE ...]``: print the rule file."""
    parser = argparse.ArgumentParser(
        prog="python3 -m moerl.telemetry.alerts", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    data: dict = {}
    names = ", ".join(f.name for f in dataclasses.fields(AlertParams))
    for item in args.overrides:  # apply_overrides' message speaks of run-config sections
        if "=" not in item or not item.split("=", 1)[0].strip():
            print(f"moerl.telemetry.alerts: --set {item!r} must look like NAME=VALUE, NAME one of: {names}",
                  file=sys.stderr)  # fmt: skip
            return 2
    try:
        apply_overrides(data, args.overrides)
        params = from_dict(AlertParams, data)
    except ConfigError as e:
        print(f"moerl.telemetry.alerts: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_rules(params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
