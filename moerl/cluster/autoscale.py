"""Rollout capacity from the fleet's scaling hint, through the Ray autoscaler's API.

``FleetManager.scaling_hint`` (queue and buffer depth, clamped to ``[fleet.min_workers,
fleet.max_workers]``) says how many rollout workers the run wants. ``RolloutCapacity.update`` turns a
changed hint into ``ray.autoscaler.sdk.request_resources(bundles=[worker bundle] x desired)``: the
autoscaler then keeps enough rollout nodes for that many workers (a request is for total capacity, not
on top of what runs), adding nodes when the hint grows and letting idle ones go when it shrinks, never
beyond the rollout group's ``minReplicas``/``maxReplicas`` that KubeRay enforces.

One worker's bundle is what ``RolloutWorkerActor`` requests: 1 CPU, its GPUs, and the ``rollout``
resource. On a Ray instance without the ``rollout`` resource (a laptop) nothing is requested.
"""

from __future__ import annotations

from collections.abc import Callable

from moerl.cluster.resources import ACTOR_REQUEST, RAY_RESOURCE

RequestFn = Callable[..., None]
"""``ray.autoscaler.sdk.request_resources``-compatible: called with ``bundles=[...]``."""


class RolloutCapacity:
    """Requests rollout capacity for the hinted number of workers, once per change.

    Args:
        bundle: resources of one rollout worker, e.g. ``{"CPU": 1, "GPU": 8, "rollout": 0.001}``.
        min_workers, max_workers: the fleet's bounds; a hint outside them is clamped.
        request: the autoscaler call; None: ``ray.autoscaler.sdk.request_resources``.

    Raises:
        ValueError: ``min_workers > max_workers`` or a negative bound.
    """

    def __init__(
        self,
        bundle: dict[str, float],
        *,
        min_workers: int,
        max_workers: int,
        request: RequestFn | None = None,
    ) -> None:
        if not 0 <= min_workers <= max_workers:
            raise ValueError(
                f"RolloutCapacity: need 0 <= min_workers={min_workers} <= max_workers={max_workers}"
            )
        self.bundle = dict(bundle)
        self.min_workers = min_workers
        self.max_workers = max_workers
        self._request = request
        self.requested: int | None = None
        """Workers of the last request (None before the first)."""
        self.num_requests = 0

    @classmethod
    def for_ray(
        cls, *, gpus_per_worker: float, min_workers: int, max_workers: int, request: RequestFn | None = None
    ) -> RolloutCapacity | None:
        """The capacity of the connected Ray instance's rollout group; None when it has no ``rollout``
        resource (nothing to scale: a laptop or a fixed cluster)."""
        import ray  # lazy: only a Ray fleet scales

        name = RAY_RESOURCE["rollout"]
        if name not in ray.cluster_resources():
            return None
        bundle = {"CPU": 1.0, name: ACTOR_REQUEST["rollout"]}
        if gpus_per_worker:
            bundle["GPU"] = float(gpus_per_worker)
        return cls(bundle, min_workers=min_workers, max_workers=max_workers, request=request)

    def update(self, desired_workers: int) -> int | None:
        """Request capacity for ``desired_workers`` (clamped to the bounds) if it changed since the last
        request; returns the workers requested now, or None when nothing was sent."""
        want = max(self.min_workers, min(self.max_workers, desired_workers))
        if want == self.requested:
            return None
        request = self._request
        if request is None:
            from ray.autoscaler.sdk import request_resources as request  # lazy: Ray is optional here
        request(bundles=[dict(self.bundle) for _ in range(want)])
        self.requested = want
        self.num_requests += 1
        return want
