"""Where a run's Ray actors go on a cluster with node groups (``moerl.cluster.resources``), by one rule:
the run's state never sits on a Spot rollout node.

    actor                               placed on
    exchange (task queue + buffer)      a node with ``exchange``; without one, the driver's own node
    weight store writer                 the driver itself (``moerl train``'s process: the trainer)
    trainer ranks (trainer.num_ranks>1) nodes with ``train``; none while the cluster has ``rollout`` nodes
                                        but no ``train`` (a ConfigError), anywhere on a plain instance
    rollout workers, EP followers       nodes with ``rollout`` when the cluster defines it
    environment actors                  nodes with ``env`` when the cluster defines it

Losing a rollout node then costs only rollout work (leases expire and requeue); losing the exchange's
node stops the run (``moerl.errors.ExchangeLostError``) with its newest checkpoint whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.cluster.resources import ACTOR_REQUEST, RAY_RESOURCE
from moerl.configlib import ConfigError


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one actor goes: ``resources`` (custom resource -> amount, a token 0.001) to request, and
    ``node_id`` (a Ray node id, hex str) to pin it to with a hard node affinity, or None."""

    resources: dict[str, float] = field(default_factory=dict)
    node_id: str | None = None

    def ray_options(self) -> dict:
        """``actor_cls.options(**...)`` keywords: ``resources`` and, when pinned, a hard
        ``NodeAffinitySchedulingStrategy`` (the actor fails rather than land elsewhere)."""
        opts: dict = {"resources": dict(self.resources)}
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: Ray is optional

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False)
        return opts


def exchange_placement(available: dict[str, float], driver_node_id: str | None) -> Placement:
    """The exchange actor's placement (module docstring).

    Args:
        available: the cluster's resources (``ray.cluster_resources()``).
        driver_node_id: the Ray node id of the driver (``ray.get_runtime_context().get_node_id()``);
            None only where no driver node is known (then the exchange goes wherever Ray puts it, which is
            refused on a cluster with a ``rollout`` group).

    Raises:
        ConfigError: the cluster has a ``rollout`` group, no ``exchange`` resource and no driver node id.
    """
    name = RAY_RESOURCE["memory"]
    if name in available:
        return Placement({name: ACTOR_REQUEST["memory"]})
    if driver_node_id is None:
        if RAY_RESOURCE["rollout"] in available:
            raise ConfigError(
                "the exchange actor needs the driver's node or a node with the `exchange` resource: the "
                "cluster has `rollout` nodes, no `exchange` resource and the driver's node is unknown"
            )
        return Placement()
    return Placement(node_id=driver_node_id)


def trainer_rank_resources(available: dict[str, float]) -> dict[str, float]:
    """The custom resources each trainer rank actor requests: ``{"train": 0.001}`` on a cluster with a
    ``train`` group, ``{}`` on a plain Ray instance.

    Raises:
        ConfigError: the cluster has ``rollout`` nodes but no ``train`` resource, where ranks could land
            on (and die with) Spot rollout nodes.
    """
    name = RAY_RESOURCE["train"]
    if name in available:
        return {name: ACTOR_REQUEST["train"]}
    if RAY_RESOURCE["rollout"] in available:
        raise ConfigError(
            "trainer.num_ranks > 1 on a cluster with `rollout` nodes but no `train` resource: the ranks "
            "would land on rollout nodes; start the training nodes with --resources '{\"train\": N}'"
        )
    return {}
