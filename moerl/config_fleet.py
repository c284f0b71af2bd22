"""Config of the interruption-tolerant rollout fleet and of its fault injection (``fleet:`` and
``chaos:`` in a run config); re-exported by ``moerl.config``, which composes them into ``RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from moerl.configlib import ConfigError, check_range


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """The elastic, interruption-tolerant rollout fleet (``moerl.runtime.fleet``, ``notice``, ``drain``)."""

    min_workers: int = 1
    """Fewest rollout workers; the controller replaces dead workers to stay at or above this."""
    max_workers: int | None = None
    """Most rollout workers (admitted mid-run up to this); ``None``: ``rollout.num_workers``."""
    replace_dead: bool = True
    """Start a replacement for each worker that dies or drains (up to ``rollout.num_workers``)."""
    heartbeat_timeout_s: float = 30.0
    """A worker that answers no liveness ping for this many seconds is declared lost and replaced."""
    check_every_s: float = 1.0
    """Seconds between the controller's fleet checks (liveness, replacement, chaos)."""
    drain_grace_s: float = 90.0
    """Seconds a worker has after a termination notice to finish in-flight groups before it releases the rest."""
    keep_partial: bool = True
    """On drain (and at a worker's stop), hand the generated token prefixes back with the task so the
    next worker continues them (else they are discarded and counted in ``rollout/tokens_discarded``)."""
    snapshot_tokens: int = 64
    """Progress snapshots (``moerl.runtime.snapshots``): each rollout worker sends the state of its
    in-flight sequences (token ids, log-probs, per-token policy versions) to the exchange each time one of
    its sequences has this many more tokens than in its last snapshot, batched, from a background thread
    (never on the decode path). A worker lost without a notice (SIGKILL, node lost) then costs at most
    about this many tokens per sequence: its tasks go back to the queue with the newest snapshot and the
    next worker continues them. 0: no snapshots (a hard loss discards every in-flight token)."""
    snapshot_poll_s: float = 0.25
    """Seconds between the snapshot thread's looks at the worker's progress (it sends only when a
    sequence crossed ``snapshot_tokens``)."""
    handle_sigterm: bool = True
    """Treat SIGTERM to a worker process as a termination notice (where a handler can be installed)."""
    notice_file: str | None = None
    """File whose appearance is a termination notice; ``{worker_id}`` is replaced by the worker's id.
    ``None``: ``RUN_DIR/notices/{worker_id}.json`` in async mode."""
    notice_url: str | None = None
    """HTTP endpoint polled for a spot ``instance-action`` document (e.g.
    ``http://169.254.169.254/latest/meta-data/spot/instance-action``); 404 means no notice."""
    imds_url: str | None = None
    """EC2 instance metadata service polled with IMDSv2 session tokens for ``spot/instance-action`` (and
    rebalance recommendations), e.g. ``http://169.254.169.254``; None: not polled. ``moerl cluster render``
    sets it for cluster runs."""
    imds_rebalance: bool = True
    """With ``imds_url``: an EC2 rebalance recommendation is a termination notice too (drain early)."""
    notice_poll_s: float = 5.0
    """Seconds between polls of ``notice_file`` / ``notice_url``."""

    def check_bounds(self, num_workers: int) -> None:
        """``min_workers <= num_workers <= max_workers`` (``num_workers``: ``rollout.num_workers``).

        Raises:
            ConfigError: naming the fields out of order.
        """
        if num_workers < self.min_workers:
            raise ConfigError(
                f"rollout.num_workers={num_workers} is below fleet.min_workers={self.min_workers}"
            )
        if self.max_workers is not None and num_workers > self.max_workers:
            raise ConfigError(
                f"rollout.num_workers={num_workers} is above fleet.max_workers={self.max_workers}"
            )

    def __post_init__(self) -> None:
        check_range("fleet.min_workers", self.min_workers, 0)
        if self.max_workers is not None:
            check_range("fleet.max_workers", self.max_workers, max(self.min_workers, 1))
        check_range("fleet.heartbeat_timeout_s", self.heartbeat_timeout_s, 0.0, lo_open=True)
        check_range("fleet.check_every_s", self.check_every_s, 0.0, lo_open=True)
        check_range("fleet.drain_grace_s", self.drain_grace_s, 0.0)
        check_range("fleet.notice_poll_s", self.notice_poll_s, 0.0, lo_open=True)
        check_range("fleet.snapshot_tokens", self.snapshot_tokens, 0)
        check_range("fleet.snapshot_poll_s", self.snapshot_poll_s, 0.0, lo_open=True)
        if self.notice_url is not None and not self.notice_url.startswith(("http://", "https://")):
            raise ConfigError(f"fleet.notice_url={self.notice_url!r} must start with http:// or https://")
        if self.imds_url is not None and not self.imds_url.startswith(("http://", "https://")):
            raise ConfigError(f"fleet.imds_url={self.imds_url!r} must start with http:// or https://")


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """Fault injection for tests and rehearsals (``moerl.runtime.chaos``); everything off by default."""

    kill_rollout_every_s: float = 0.0
    """Mean seconds between SIGKILLs of a random rollout worker (each gap drawn uniformly in
    [0.5, 1.5] x this); 0 disables."""
    notice_rollout_every_s: float = 0.0
    """Mean seconds between spot-style termination notices to a random rollout worker; 0 disables."""
    max_kills: int = 0
    """Most rollout workers killed over the run; 0: unlimited."""
    max_notices: int = 0
    """Most termination notices sent over the run; 0: unlimited."""
    start_after_s: float = 0.0
    """No fault before this many seconds after the fleet started."""
    kill_trainer_at_step: int = 0
    """Kill the trainer after this trainer step (async mode); the controller restarts it from the last
    full checkpoint. 0 disables."""
    seed: int = 0
    """Seed of the fault times and of the choice of victims."""
    slow_worker: str | None = None
    """Id of a rollout worker (e.g. ``rollout-0``) that generates at ``slow_factor`` of its speed: it
    sleeps after each scheduler step for (1 / slow_factor - 1) x the step's seconds. ``None``: off.
    For rehearsing the rate-drop and spread alerts (``deploy/prometheus/rules.yaml``)."""
    slow_factor: float = 0.5
    """Speed of ``slow_worker`` relative to its own, in (0, 1]; 0.5: half speed."""

    def __post_init__(self) -> None:
        for name in ("kill_rollout_every_s", "notice_rollout_every_s", "start_after_s"):
            check_range(f"chaos.{name}", getattr(self, name), 0.0)
        check_range("chaos.slow_factor", self.slow_factor, 0.0, 1.0, lo_open=True)
        if self.slow_worker is not None and not self.slow_worker:
            raise ConfigError("chaos.slow_worker must be a worker id such as rollout-0, or null")
        for name in ("max_kills", "max_notices", "kill_trainer_at_step"):
            check_range(f"chaos.{name}", getattr(self, name), 0)

    @property
    def is_enabled(self) -> bool:
        """Whether any fault is configured."""
        return bool(self.kill_rollout_every_s or self.notice_rollout_every_s or self.kill_trainer_at_step)
