"""Schedules: how generation, training and the weight sync of one RL step share time, and the long tail of a
batch generated from scratch.

One step trains on E = prompts x group episodes. Its parts (``StepParts``, seconds): ``gen_batch_s``, the
batch generated from scratch until its longest response ends (``batch_decode_s``); ``gen_stream_s``, the
same tokens at the throughput of a full decode batch (a stream of partial rollouts never drains);
``train_s``, the training step with its extra forward passes and checkpoint share; ``sync_s``, one weight
sync (``moerl.plan.transports``). The step time of each schedule (``SCHEDULES``):

- ``colocated``: every GPU generates, then every GPU trains, then the weights move on-device:
  gen_batch + train + sync (parts computed over all GPUs).
- ``sync``: rollout and training GPUs apart, taking turns: gen_batch + train + sync.
- ``one_step_off``: batch n + 1 is generated with version n - 1 while batch n trains, then both wait for
  the sync: max(gen_batch, train) + sync (verl's one_step_off_policy, NeMo-RL's 1-step-off async GRPO).
- ``fully_async``, staleness bound s >= 1: rollout streams with partial rollouts (interrupted at a sync,
  resumed on the new version), the trainer sends a snapshot while it trains on: the step is the slower
  side, max(gen_stream + (1 - sync_overlap) sync, train) (AReaL, arXiv:2505.24298 sec. 4; verl
  fully_async_policy). s = 0 is on-policy: the ``sync`` schedule.

Long tail (``batch_decode_s``): response lengths r ~ Gamma(shape 1 / cv^2, scale mean cv^2), cut at the
length limit. A batch of N responses ends when its longest does, at L = the (1 - 1 / (N + 1)) quantile
(the expected maximum of N draws, Gumbel 1958, order statistics), at most the limit. At decode step t a
replica holding n responses still decodes max(n S(t), 1) of them (S the survival function), each at
context P + t, so the batch takes sum_t step(max(n S(t), 1), P + t): a midpoint rule over
``TAIL_POINTS`` segments of [0, L]. A replica given more responses than its decode rows first works
through the excess at full-batch throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCHEDULES = ("colocated", "sync", "one_step_off", "fully_async")
"""``Plan.schedule`` choices (module docstring; ``auto`` resolves to one of them)."""
TAIL_POINTS = 32
"""Segments of the midpoint rule over a batch's decode steps."""


@dataclass(frozen=True, slots=True)
class StepParts:
    """The parts of one RL step, seconds (module docstring)."""

    gen_batch_s: float
    gen_stream_s: float
    train_s: float
    sync_s: float


def step_s(schedule: str, parts: StepParts, *, sync_overlap: float, max_staleness: int) -> float:
    """Seconds of one training step under ``schedule`` (module docstring).

    Raises:
        ValueError: ``schedule`` is not one of ``SCHEDULES``.
    """
    g, t, s = parts.gen_batch_s, parts.train_s, parts.sync_s
    if schedule in ("colocated", "sync") or (schedule == "fully_async" and max_staleness < 1):
        return g + t + s
    if schedule == "one_step_off":
        return max(g, t) + s
    if schedule == "fully_async":
        return max(parts.gen_stream_s + (1 - sync_overlap) * s, t)
    raise ValueError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")


def gamma_sf(t: float, mean: float, cv: float) -> float:
    """P(r > t) for r ~ Gamma(shape 1 / cv^2, scale mean cv^2) (mean ``mean``, std cv mean); cv > 0."""
    shape, scale = 1 / cv**2, mean * cv**2
    return float(
        torch.special.gammaincc(
            torch.tensor(shape, dtype=torch.float64), torch.tensor(t / scale, dtype=torch.float64)
        )
    )


def gamma_quantile(q: float, mean: float, cv: float) -> float:
    """The length t with P(r <= t) = q (bisection on ``gamma_sf`` to 1e-6 relative), tokens."""
    lo, hi = 0.0, mean
    while gamma_sf(hi, mean, cv) > 1 - q:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gamma_sf(mid, mean, cv) > 1 - q else (lo, mid)
    return (lo + hi) / 2


def longest_response(mean: float, cv: float, num_responses: float, limit: float = 0.0) -> float:
    """Expected longest of ``num_responses`` Gamma(mean, cv) lengths, tokens, at most ``limit`` (0: none);
    cv = 0: every response has the mean length."""
    if cv <= 0:
        return mean if not limit else min(mean, limit)
    longest = gamma_quantile(1 - 1 / (num_responses + 1), mean, cv)
    return min(longest, limit) if limit else longest


def batch_decode_s(
    step_at: Callable[[float, float], float],
    *,
    per_replica: float,
    rows: float,
    num_responses: float,
    prompt_len: float,
    mean: float,
    cv: float,
    limit: float = 0.0,
) -> float:
    """Decode time of a batch generated from scratch, tail included (module docstring).

    Args:
        step_at: (decode rows of the replica, context tokens) -> seconds of one decode step.
        per_replica: responses one replica generates; rows: its concurrent decode rows.
        num_responses: responses of the whole batch (the step waits for the longest of them).
        prompt_len, mean, cv, limit: P, mean response tokens, their coefficient of variation, the limit.
    """
    longest = longest_response(mean, cv, num_responses, limit)
    excess = max(0.0, per_replica - rows)  # waits for a free row: generated at full-batch throughput
    start = excess * mean * step_at(rows, prompt_len + mean / 2) / rows
    n = min(per_replica, rows)
    sf = (lambda t: 1.0) if cv <= 0 else (lambda t: gamma_sf(t, mean, cv))
    dt = longest / TAIL_POINTS
    tail = sum(
        dt * step_at(max(n * sf((i + 0.5) * dt), 1.0), prompt_len + (i + 0.5) * dt)
        for i in range(TAIL_POINTS)
    )
    return start + tail
