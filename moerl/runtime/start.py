"""The rollout side a run's placement asks for, started from one description (``RolloutsStart``).

    Placement.rollout.runs_on   ->  ROLLOUT_SIDES[...]  ->  a ``Rollouts``
      driver                         LocalRollouts.start      (sync: queue, buffer, one worker in process)
      ray_actors                     RayRollouts(...)          (async: exchange actor + worker actors)

The run (``moerl.train``) calls ``start_rollouts`` and never names an implementation; a new rollout side
is one entry in ``ROLLOUT_SIDES`` that passes ``tests/unit/test_rollouts_protocol.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moerl.config import RunConfig
from moerl.placement import IN_DRIVER, RAY_ACTORS, Placement
from moerl.runtime.build import Components
from moerl.runtime.local import LocalRollouts
from moerl.runtime.ray.rollouts import RayRollouts
from moerl.runtime.rollouts import Rollouts
from moerl.weights.store import WeightStore


@dataclass(frozen=True, slots=True)
class RolloutsStart:
    """What a rollout side starts from."""

    cfg: RunConfig
    """The run config."""
    placement: Placement
    """Where the run's parts run (``Placement.from_config(cfg)``)."""
    comp: Components | None
    """The driver's tokenizer, task and policy (the in-process side copies the policy); None while they are
    still being built (``Placement.starts_rollouts_early``: a side that starts early needs none)."""
    init_path: str | None
    """HF folder the workers build their model from (version 0's weights; later ones from the store)."""
    store: WeightStore
    """The run's weight store (written in the background; what workers that start later load)."""
    version: int
    """The trainer's policy version the rollouts start at (0 fresh, the checkpoint's when resumed)."""
    parts: dict | None
    """Checkpoint parts with the ``queue`` and ``buffer`` state to restore; None for a fresh run."""
    notice_dir: Path | None = None
    """Where workers look for interruption notices when ``fleet.notice_file`` is unset (Ray workers)."""


def _in_driver(start: RolloutsStart) -> Rollouts:
    if start.comp is None:
        raise ValueError(
            "the in-process rollout side copies the driver's policy: start it after the components"
        )
    return LocalRollouts.start(start.cfg, start.comp, start.version, start.parts)


def _on_ray(start: RolloutsStart) -> Rollouts:
    return RayRollouts(
        start.cfg,
        start.init_path,
        start.store.url,
        version=start.version,
        parts=start.parts,
        notice_dir=start.notice_dir,
        store=start.store,
    )


ROLLOUT_SIDES: dict[str, Callable[[RolloutsStart], Rollouts]] = {IN_DRIVER: _in_driver, RAY_ACTORS: _on_ray}
"""``Placement.rollout.runs_on`` -> the function that starts that rollout side."""


def start_rollouts(start: RolloutsStart) -> Rollouts:
    """Start the rollout side ``start.placement`` places (``ROLLOUT_SIDES``).

    Raises:
        KeyError: a placement with no registered rollout side (a new ``runs_on`` value).
    """
    return ROLLOUT_SIDES[start.placement.rollout.runs_on](start)
