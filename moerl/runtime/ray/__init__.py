"""Async mode on Ray: the rollout side as actors (``RayRollouts``), the exchange actor that holds the
queue and the buffer, the rollout worker actor, and the fleet backend that spawns and watches workers.

    rollouts.py      RayRollouts (the ``Rollouts`` of async mode), init_ray, check_ray_address
    local.py         retry_ray_start, start_local_ray: Ray started again when its raylet wait runs out;
                     stops_ray_it_started: a run shuts down the Ray connection it made
    address.py       ray_head: a ``runtime.ray_address`` read as ``ray.init`` reads it, without connecting
    exchange.py      ExchangeActor: TaskQueue + ExperienceBuffer in one actor, the staleness gate
    worker_actor.py  RolloutWorkerActor and the proxies it reaches the exchange through
    backend.py       RayWorkerBackend: the FleetManager's hands on worker actors
    reward_pool.py   RewardWorkerActor, RayRewardPool: reward workers the exchange scores deliveries on

No module here imports Ray at import time.
"""

from moerl.runtime.ray.local import retry_ray_start, start_local_ray, stops_ray_it_started
from moerl.runtime.ray.rollouts import RayRollouts, check_ray_address, init_ray

__all__ = [
    "RayRollouts",
    "check_ray_address",
    "init_ray",
    "retry_ray_start",
    "start_local_ray",
    "stops_ray_it_started",
]
