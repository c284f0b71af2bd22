"""The Ray custom resources that map moerl's actors onto node groups.

Each worker group of a cluster (``moerl.config_cluster``) starts its Ray nodes with one custom resource;
an actor that requests it can only be placed on that group's nodes. A laptop's local Ray instance has
none of them, and then nothing is requested (``actor_resources`` returns ``{}``), so the same code runs
on both.

    group     Ray resource   per node                        requested by
    train     train          GPUs of the node                 trainer ranks, the job's driver
    rollout   rollout        rollout workers the node holds   rollout workers
    cpu       env            vCPUs of the node                environments, preprocessing
    memory    exchange       1                                the exchange actor (queue + buffer)
    reward    reward         reward workers the node holds    reward workers (only with reward.model_path)

Every actor requests a token amount (0.001) of its group's resource: the custom resource only says
where, Ray's own ``CPU``/``GPU`` requests bound how many actors fit a node (a trainer rank takes one
GPU, as ``moerl.trainer.distributed.ray_ranks`` asks). The names avoid Ray's built-in ``memory`` resource.
"""

from __future__ import annotations

import math

from moerl.config import RunConfig

GROUPS = ("train", "rollout", "cpu", "memory")
"""Worker groups every deployment has, in the order they are rendered."""

RAY_RESOURCE = {
    "train": "train",
    "rollout": "rollout",
    "cpu": "env",
    "memory": "exchange",
    "reward": "reward",
}
"""Ray custom resource advertised by each worker group's nodes."""

ACTOR_REQUEST = {"train": 0.001, "rollout": 0.001, "cpu": 0.001, "memory": 0.001, "reward": 0.001}
"""Amount of its group's resource one actor requests: a token amount (only placement matters)."""

DRIVER_REQUEST = {"train": 0.001}
"""What the job's driver (``moerl train``, the trainer's process) requests: a training node."""


def run_groups(cfg: RunConfig) -> tuple[str, ...]:
    """The worker groups of this run, in render order: ``GROUPS``, and ``reward`` when
    ``reward.model_path`` is set (the reward workers' GPU nodes)."""
    return (*GROUPS, "reward") if cfg.reward.is_enabled else GROUPS


def node_resources(cfg: RunConfig, group: str) -> dict[str, float]:
    """The custom resources one Ray node of ``group`` advertises (``ray start --resources``); a rollout
    node holds ``cluster.rollout.gpus_per_node // rollout.ep_size`` workers (the run's own EP size), a
    reward node ``floor(cluster.reward.gpus_per_node / reward.gpus_per_worker)`` reward workers.

    Raises:
        KeyError: ``group`` is not one of ``GROUPS`` or ``reward``.
    """
    spec = getattr(cfg.cluster, group) if group in RAY_RESOURCE else None
    if spec is None:
        raise KeyError(f"unknown worker group {group!r}; expected one of {list(RAY_RESOURCE)}")
    amount = {
        "train": lambda: spec.gpus_per_node,
        "rollout": lambda: spec.gpus_per_node // cfg.rollout.ep_size,
        "cpu": lambda: spec.cpus_per_node,
        "memory": lambda: 1,
        "reward": lambda: math.floor(spec.gpus_per_node / cfg.reward.gpus_per_worker),
    }[group]()
    return {RAY_RESOURCE[group]: float(amount)}


def actor_resources(group: str, available: dict[str, float] | None = None) -> dict[str, float]:
    """The ``resources=`` an actor of ``group`` requests, if the cluster defines the group's resource.

    Args:
        group: one of ``GROUPS``.
        available: the cluster's resources (``ray.cluster_resources()``); None: read them from the
            connected Ray instance (``ray.init`` must have run).

    Returns:
        ``{name: amount}``, or ``{}`` on a Ray instance without the resource (a laptop).
    """
    name = RAY_RESOURCE[group]
    if available is None:
        import ray  # lazy: the render and the config do not need Ray

        available = ray.cluster_resources()
    return {name: ACTOR_REQUEST[group]} if name in available else {}
