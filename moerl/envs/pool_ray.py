"""Environment workers as Ray actors (async mode): ``RayEnvPool``.

Each rollout worker owns ``env.num_workers`` ``EnvWorkerActorImpl`` actors (created from its own
process; they die with it). An actor requests ``env.num_cpus`` CPUs and, when the cluster defines the
custom resource ``cpu`` (a CPU node group for environments, apart from the GPU nodes), a sliver of it,
so the scheduler places it there. An actor is threaded: it serves up to ``env.max_pending_per_worker``
calls at once (the most the pool sends it), plus ``pid``. A dead actor (process killed, node
lost) shows as ``RayActorError`` on its calls: the pool counts ``died``, ends its episodes and starts
a replacement; a call past ``env.step_timeout_s`` kills the actor the same way (``timeout``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from moerl.envs.base import load_env_class
from moerl.envs.pool import EnvCall, EnvHost, _PoolBase, _Worker

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config_env import EnvConfig

ENV_RESOURCE = "cpu"
"""Custom Ray resource that environment actors request when the cluster defines it."""


class EnvWorkerActorImpl:
    """One environment worker process: an ``EnvHost`` over the environment class at ``import_path``."""

    def __init__(self, import_path: str, cfg: EnvConfig) -> None:
        env_cls = load_env_class(import_path)
        self.host = EnvHost(lambda: env_cls(cfg))

    def call(self, episode: str, kind: str, payload) -> tuple[str | None, object]:
        """``EnvHost.call``: ``(None, value)`` or ``("raised", message)``."""
        return self.host.call(episode, kind, payload)

    def pid(self) -> int:
        """This worker's process id (for fault injection and tests)."""
        return os.getpid()


class RayEnvPool(_PoolBase):
    """``env.num_workers`` environment actors for the environment class ``env_cls``."""

    def __init__(self, env_cls: type, cfg: EnvConfig) -> None:
        import ray  # noqa: PLC0415 - ray is optional and heavy

        self._ray = ray
        self.cfg = cfg
        self.import_path = f"{env_cls.__module__}:{env_cls.__qualname__}"
        labels = {ENV_RESOURCE: 0.001} if ray.cluster_resources().get(ENV_RESOURCE) else {}
        self._actor_cls = ray.remote(
            num_cpus=cfg.num_cpus, max_concurrency=cfg.max_pending_per_worker + 1, resources=labels
        )(EnvWorkerActorImpl)
        self._owner: dict = {}  # object ref -> worker
        super().__init__(
            cfg.num_workers,
            step_timeout_s=cfg.step_timeout_s,
            max_pending_per_worker=cfg.max_pending_per_worker,
        )

    def _spawn(self, index: int) -> _Worker:
        actor = self._actor_cls.remote(self.import_path, self.cfg)
        worker = _Worker(index, handle=actor)
        worker.pid = self._ray.get(actor.pid.remote(), timeout=120)
        return worker

    def _dispatch(self, worker: _Worker, call: EnvCall):
        ref = worker.handle.call.remote(call.episode, call.kind, call.payload)
        self._owner[ref] = worker
        return ref

    def _collect(self, timeout_s: float):
        ray = self._ray
        refs = list(self._owner)
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            worker = self._owner.pop(ref)
            try:
                error, value = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                error, value = "died", f"environment worker {worker.pid} died: {type(e).__name__}"
            except ray.exceptions.RayError as e:
                error, value = "raised", f"{type(e).__name__}: {e}"
            out.append((worker, ref, error, value))
        return out

    def _kill(self, worker: _Worker) -> None:
        for ref in [r for r, w in self._owner.items() if w is worker]:
            del self._owner[ref]
        self._ray.kill(worker.handle, no_restart=True)
