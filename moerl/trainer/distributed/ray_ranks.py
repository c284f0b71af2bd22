"""Training ranks as Ray actors (async mode), in one placement group, behind ``LocalRanks``' interface.

Placement: one bundle per rank, packed (``PACK``: as few nodes as possible, so EP groups stay inside
nodes), each bundle asking for the ``train`` custom resource when the cluster defines it, so ranks
land on the trainer node group and never on spot rollout capacity (a cluster with ``rollout`` nodes but
no ``train`` resource is refused: ``moerl.cluster.placement``). On GPUs each rank gets one GPU;
when the cluster has fewer GPUs than trainer ranks plus rollout workers (one GPU: the commonest
case), every process gets the same fraction ``GPUs / (ranks + workers)`` instead of failing to
schedule: they then share the GPU's memory and time (see README). On CPU the ranks share the cores
the rollout workers leave (fractional ``CPU``) and talk over gloo. Rank 0's actor picks the
``tcp://`` rendezvous address.

Ray is imported lazily (only async runs use this module's classes).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

from moerl.cluster.placement import trainer_rank_resources
from moerl.config import RunConfig
from moerl.trainer.distributed.checkpoint import ShardedCheckpointError
from moerl.trainer.distributed.rank import RankSpec, RankTrainer, TrainerRankError, unwrap_reply
from moerl.trainer.local import NonFiniteLossError


class RankActorImpl:
    """The body of one rank actor: ``start`` builds the ``RankTrainer`` (collective over the group),
    ``call`` runs one of its commands and returns ``(kind, value)`` as ``serve`` replies."""

    def __init__(self) -> None:
        self.rank: RankTrainer | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0 hosts the rendezvous)."""
        import ray  # lazy: Ray is only needed in async mode

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def start(self, spec: RankSpec) -> tuple[str, Any]:
        """Join the group and build this rank's shard (blocks until every rank has joined)."""
        torch.set_num_threads(1)
        try:
            self.rank = RankTrainer(spec)
            return "ok", self.rank.counters()
        except Exception:
            return "error", f"trainer rank {spec.rank} failed to start:\n{traceback.format_exc()}"

    def call(self, method: str, args: tuple) -> tuple[str, Any]:
        """Run ``RankTrainer.<method>(*args)``."""
        try:
            return "ok", getattr(self.rank, method)(*args)
        except (NonFiniteLossError, ShardedCheckpointError) as e:  # re-raised as they are by the driver
            return "raise", e
        except Exception:
            return (
                "error",
                f"trainer rank {self.rank.mesh.rank if self.rank else '?'}, {method}:\n{traceback.format_exc()}",
            )


def _bundle(cfg: RunConfig, num_ranks: int) -> dict[str, float]:
    """Resources of one rank's bundle (see the module docstring)."""
    import ray

    total = ray.cluster_resources()
    workers = cfg.rollout.num_workers * cfg.rollout.ep_size  # rollout processes (EP ranks of each worker)
    bundle: dict[str, float] = {}
    if cfg.model.device.startswith("cuda"):
        gpus = total.get("GPU", 0.0)
        bundle["GPU"] = 1.0 if gpus >= num_ranks + workers else gpus / (num_ranks + workers)
        bundle["CPU"] = 1.0
    else:
        spare = total.get("CPU", 1.0) - workers  # the rollout workers take one CPU each
        bundle["CPU"] = max(0.01, min(1.0, spare / num_ranks))
    bundle.update(trainer_rank_resources(total))  # only `train` nodes (moerl.cluster.placement)
    return bundle


class RayRanks:
    """R rank actors in a placement group; ``send``/``gather``/``close``/``pids`` as ``LocalRanks``.

    Raises:
        TrainerRankError: the placement group cannot be placed within ``place_timeout_s``.
    """

    def __init__(self, cfg: RunConfig, specs: list[RankSpec], *, place_timeout_s: float = 60.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self._remove_pg, self._error = ray, remove_placement_group, TrainerRankError
        bundle = _bundle(cfg, len(specs))
        self.pg = placement_group([bundle] * len(specs), strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=place_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise TrainerRankError(
                f"cannot place {len(specs)} trainer ranks of {bundle} each within {place_timeout_s:.0f} s "
                f"(cluster: {ray.cluster_resources()}); lower trainer.num_ranks"
            )
        actor_cls = ray.remote(max_concurrency=2)(RankActorImpl)
        self.actors = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote()
            for r in range(len(specs))
        ]
        ip, port = ray.get(self.actors[0].address.remote())
        url = f"tcp://{ip}:{port}"
        self._pids = ray.get([a.pid.remote() for a in self.actors])
        self.pending = [
            a.start.remote(replace(s, init_method=url)) for a, s in zip(self.actors, specs, strict=True)
        ]

    @property
    def pids(self) -> list[int]:
        """Process id of each rank actor."""
        return list(self._pids)

    def send(self, method: str, per_rank_args) -> None:
        self.pending = [
            a.call.remote(method, args) for a, args in zip(self.actors, per_rank_args, strict=True)
        ]

    def gather(self, timeout_s: float) -> list[Any]:
        """Every rank's reply; ``TrainerRankError`` on an actor death, an error or a timeout."""
        ray = self._ray
        deadline = time.monotonic() + timeout_s
        pending, replies = list(self.pending), {}
        while len(replies) < len(pending):
            todo = [ref for i, ref in enumerate(pending) if i not in replies]
            done, _ = ray.wait(todo, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = [i for i in range(len(pending)) if i not in replies]
                raise self._error(
                    f"trainer ranks {late} (pids {[self._pids[i] for i in late]}) did not answer within {timeout_s:.0f} s"
                )
            i = pending.index(done[0])
            try:
                replies[i] = unwrap_reply(ray.get(done[0]))
            except ray.exceptions.RayActorError:
                raise self._error(f"trainer rank {i} (pid {self._pids[i]}) died") from None
        return [replies[i] for i in range(len(pending))]

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the process groups, then end the actors and the placement group."""
        ray = self._ray
        refs = [a.call.remote("close", ()) for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for a in self.actors:
            ray.kill(a)
        self._remove_pg(self.pg)
