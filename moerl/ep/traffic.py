"""EP traffic of whole models, by direction: what a trainer rank or a rollout rank reports to telemetry.

Each dispatcher counts the bytes its rank sent (``Dispatcher.traffic_by_direction``: ``dispatch`` towards
the experts' ranks, ``combine`` back to the tokens' ranks, backward passes included). A model built by
``moerl.ep.parallelize`` shares one dispatcher over all its MoE layers; a trainer rank may hold several
models (policy, frozen reference, critic), each with its own. ``model_dispatchers`` finds them,
``dispatcher_traffic`` sums their counters, and a step's traffic is the difference of two readings
(``traffic_delta``); ``sum_traffic`` adds the readings of several ranks.

A reading is ``{"dispatch": Traffic, "combine": Traffic}``, or None where there is no dispatcher (no EP).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from moerl.ep.dispatcher import Dispatcher
from moerl.ep.layout import Traffic
from moerl.ep.parallelize import ExpertParallelExperts

DIRECTIONS: tuple[str, ...] = ("dispatch", "combine")
"""The keys of a reading (the ``direction`` label of ``moerl_ep_bytes_total``)."""

DirectionTraffic = dict[str, Traffic]
"""``{"dispatch": Traffic, "combine": Traffic}``: bytes and messages a rank sent, by direction."""


def model_dispatchers(*models: nn.Module | None) -> list[Dispatcher]:
    """The distinct dispatchers of the ``ExpertParallelExperts`` modules of ``models`` (None skipped),
    in first-seen order; [] for models without expert parallelism."""
    out: dict[int, Dispatcher] = {}
    for model in models:
        if model is None:
            continue
        for m in model.modules():
            if isinstance(m, ExpertParallelExperts):
                out.setdefault(id(m.dispatcher), m.dispatcher)
    return list(out.values())


def dispatcher_traffic(dispatchers: Iterable[Dispatcher]) -> DirectionTraffic | None:
    """The sum of the dispatchers' ``traffic_by_direction`` since they were built (this rank's sends,
    cumulative); None when there is none. Reads host counters only: no device sync, no collective."""
    dispatchers = list(dispatchers)
    if not dispatchers:
        return None
    total = {d: Traffic() for d in DIRECTIONS}
    for disp in dispatchers:
        for d in DIRECTIONS:
            total[d] = total[d] + disp.traffic_by_direction[d]
    return total


def traffic_delta(after: DirectionTraffic | None, before: DirectionTraffic | None) -> DirectionTraffic | None:
    """``after - before`` per direction (a step's traffic from two cumulative readings); None if ``after``
    is None, ``before`` None counting as zero.

    Raises:
        ValueError: a count went down (``before`` is not an earlier reading of the same counters).
    """
    if after is None:
        return None
    out = {d: after[d] - before[d] if before is not None else after[d] for d in DIRECTIONS}
    if any(min(t.intra_node_bytes, t.inter_node_bytes) < 0 for t in out.values()):
        raise ValueError(f"EP traffic went down between two readings: {before} -> {after}")
    return out


def sum_traffic(readings: Iterable[DirectionTraffic | None]) -> DirectionTraffic | None:
    """The per-direction sum of several ranks' readings; None when every reading is None (no EP)."""
    out: DirectionTraffic | None = None
    for r in readings:
        if r is None:
            continue
        out = dict(r) if out is None else {d: out[d] + r[d] for d in DIRECTIONS}
    return out


class RoutingLog:
    """The routing of every dispatch of ``dispatchers`` on this rank, in call order: what the planner
    replays (``moerl.plan.replay.replayed_traffic``) to predict the bytes those dispatches send.

    Wraps each dispatcher's ``dispatch`` (an instance attribute over the class method; ``close`` undoes
    it). ``calls[i]`` is the i-th call's ``topk_idx`` [T, k] int64, copied to the CPU (T = 0 for a rank
    that joined a forward without tokens); every EP rank makes the same calls in the same order, so the
    i-th entries of all ranks' logs are one collective dispatch.
    """

    def __init__(self, dispatchers: Iterable[Dispatcher]) -> None:
        self.calls: list = []
        self._wrapped = list(dispatchers)
        for disp in self._wrapped:
            disp.dispatch = self._recorder(disp.dispatch)

    def _recorder(self, dispatch):
        def recorded(x, topk_idx, topk_weights):
            self.calls.append(topk_idx.detach().to("cpu", copy=True))
            return dispatch(x, topk_idx, topk_weights)

        return recorded

    def close(self) -> None:
        """Stop recording (the dispatchers' own ``dispatch`` again)."""
        for disp in self._wrapped:
            del disp.dispatch
        self._wrapped = []
