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

No module here imports Ray at import time, and importing one module of the package imports no other:
an actor's process (the exchange, a reward worker) loads only the module its class lives in, without the
driver's ``rollouts.py`` and the torch it needs. The names below resolve on first use (PEP 562).
"""

import importlib

_MODULE_OF = {
    "RayRollouts": "rollouts",
    "check_ray_address": "rollouts",
    "init_ray": "rollouts",
    "retry_ray_start": "local",
    "start_local_ray": "local",
    "stops_ray_it_started": "local",
}

__all__ = [
    "RayRollouts",
    "check_ray_address",
    "init_ray",
    "retry_ray_start",
    "start_local_ray",
    "stops_ray_it_started",
]


def __getattr__(name: str):
    """``moerl.runtime.ray.<name>`` of ``__all__``: imported from its module on first access.

    Raises:
        AttributeError: ``name`` is not one of the package's names (nor a submodule already imported).
    """
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
