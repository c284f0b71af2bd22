"""Bytes a run's own dispatches send, by the planner's exact-traffic rule: the prediction a measured run
(``moerl.ep.traffic.RoutingLog``) is compared with. Kept out of ``moerl.plan.traffic`` so that adding it did
not change the frozen planner model (``moerl.plan.freeze.MODEL_MODULES``)."""

from __future__ import annotations

import torch

from moerl.ep.layout import Traffic
from moerl.ep.placement import ExpertPlacement
from moerl.plan.traffic import PHASES, RowBytes, exact_traffic


def replayed_traffic(
    calls_per_rank: list[list[torch.Tensor]], placement: ExpertPlacement, rows: RowBytes
) -> dict[str, list[Traffic]]:
    """``exact_traffic`` summed over a run's dispatches: the bytes each rank sends, by phase.

    Args:
        calls_per_rank: R lists (one per EP rank) of the ``topk_idx`` [T, k] int64 of each dispatch in
            call order (``moerl.ep.traffic.RoutingLog.calls``); the i-th entries of all ranks are one
            collective call.
        placement, rows: as ``exact_traffic``.
    Returns:
        ``{phase: [Traffic of rank 0 .. R-1]}`` for the four ``PHASES`` (forward passes only).
    Raises:
        ValueError: not one list per rank, or ranks logged different numbers of calls.
    """
    r = placement.topology.world_size
    counts = {len(calls) for calls in calls_per_rank}
    if len(calls_per_rank) != r or len(counts) > 1:
        raise ValueError(
            f"need the dispatch log of each of the {r} EP ranks, with the same number of calls; got "
            f"{len(calls_per_rank)} logs of {sorted(len(c) for c in calls_per_rank)} calls"
        )
    total = {p: [Traffic() for _ in range(r)] for p in PHASES}
    for call in zip(*calls_per_rank, strict=True):
        for phase, per_rank in exact_traffic(list(call), placement, rows).items():
            total[phase] = [a + b for a, b in zip(total[phase], per_rank, strict=True)]
    return total
