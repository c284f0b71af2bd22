"""Counters of environment calls and episodes, kept by each rollout worker and merged for the run."""

from __future__ import annotations

from dataclasses import dataclass, field

LATENCY_WINDOW = 4096
"""Most recent call latencies kept per worker for the percentiles."""


@dataclass(slots=True)
class EnvStats:
    """Environment figures of one rollout worker (cumulative; latencies over the recent window)."""

    calls: int = 0
    """reset and step calls answered (errors included)."""
    errors: int = 0
    """Episodes ended by an environment fault: raised + timeouts + died + lost."""
    raised: int = 0
    """Calls whose environment raised (or broke the step() contract)."""
    timeouts: int = 0
    """Calls that ran past ``env.step_timeout_s``."""
    died: int = 0
    """Calls whose worker process died."""
    lost: int = 0
    """Episodes ended because their worker was lost while serving another episode's call."""
    workers_lost: int = 0
    """Environment workers killed and replaced (timeouts and deaths)."""
    episodes: int = 0
    """Episodes finished without an error."""
    turns: int = 0
    """Policy turns of those episodes."""
    parked_max: int = 0
    """Most episodes parked at once (waiting on their environment)."""
    backlog_max: int = 0
    """Most calls waiting at once for room on their worker (backpressure)."""
    decode_steps_parked: int = 0
    """Engine steps taken while at least one episode was parked."""
    latencies_s: list[float] = field(default_factory=list)
    """Recent call latencies in seconds (submit to answer, queueing on the worker included)."""

    def record_call(self, latency_s: float, error: str | None) -> None:
        """One answered call."""
        self.calls += 1
        self.latencies_s.append(latency_s)
        del self.latencies_s[:-LATENCY_WINDOW]
        if error is not None:
            self.record_error(error)

    def record_error(self, kind: str) -> None:
        """One episode ended by a fault of ``kind`` (raised, timeout, died, lost)."""
        self.errors += 1
        attr = {"timeout": "timeouts"}.get(kind, kind)
        setattr(self, attr, getattr(self, attr) + 1)

    def record_loss(self, kind: str) -> None:
        """A worker was killed and replaced."""
        self.workers_lost += 1


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def merge(stats: list[EnvStats]) -> dict:
    """Run-level figures of several workers' ``EnvStats`` (``summary.json``'s ``env`` section)."""
    lat = [x for s in stats for x in s.latencies_s]
    total = {
        k: sum(getattr(s, k) for s in stats)
        for k in (
            "calls",
            "errors",
            "raised",
            "timeouts",
            "died",
            "lost",
            "workers_lost",
            "episodes",
            "turns",
            "decode_steps_parked",
        )
    }
    return {
        **total,
        "turns_per_episode": total["turns"] / total["episodes"] if total["episodes"] else None,
        "latency_p50_s": percentile(lat, 0.50),
        "latency_p99_s": percentile(lat, 0.99),
        "parked_max": max((s.parked_max for s in stats), default=0),
        "backlog_max": max((s.backlog_max for s in stats), default=0),
    }


def step_values(groups, worker_stats: list) -> dict:
    """The step's ``env/*`` metrics (``moerl.telemetry.metrics.METRIC_KEYS``): turns per episode of the
    step's samples, and latency percentiles, faults and parking from the workers' ``EnvStats``
    (``worker_stats``: their ``EpisodeWorkerStats``; workers without ``env`` are skipped)."""
    turns = [s.reward_info.get("turns") for g in groups for s in g.samples]
    turns = [t for t in turns if t is not None]
    merged = merge([w.env for w in worker_stats if hasattr(w, "env")])
    return {
        "env/turns_mean": sum(turns) / len(turns) if turns else None,
        "env/latency_p50_s": merged["latency_p50_s"],
        "env/latency_p99_s": merged["latency_p99_s"],
        "env/errors": merged["errors"],
        "env/timeouts": merged["timeouts"],
        "env/parked_max": merged["parked_max"],
    }
