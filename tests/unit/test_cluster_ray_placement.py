"""The Ray resource mapping of a rendered cluster, on a local three-node Ray cluster.

The nodes start with the custom resources ``moerl cluster render`` declares for the memory (the head),
train and rollout groups. Rollout workers request theirs the way ``RayRollouts`` does
(``moerl.runtime.ray.rollouts._labels``), trainer ranks and the exchange through ``actor_resources``; each
lands only on its group's node, and a rollout worker that does not fit waits instead of spilling onto
the training node. The fleet's scaling hint reaches the Ray autoscaler as a resource request.
"""

import json

import pytest
import ray
from ray.cluster_utils import Cluster

from moerl.cluster.autoscale import RolloutCapacity
from moerl.cluster.render import cluster_run_config
from moerl.cluster.resources import actor_resources, node_resources
from moerl.config import load_config
from moerl.runtime.ray.local import retry_ray_start
from moerl.runtime.ray.rollouts import _labels

pytestmark = pytest.mark.timeout(300)  # room for a cluster start retried once (retry_ray_start)


IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""


@ray.remote
class Probe:
    """Stands in for an actor of a group: reports the node it was placed on."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    cfg = cluster_run_config(load_config("configs/cluster_qwen3_30b_1node.yaml", [IMAGE, IMAGE]))
    # no log monitors: the driver reads no worker output (log_to_driver=False below), and each node's
    # monitor would scan the session folder the three nodes share on this host for the module's duration
    quiet = {"include_log_monitor": False}
    head = {"num_cpus": 1, "resources": node_resources(cfg, "memory"), **quiet}
    train = {"num_cpus": 2, "resources": node_resources(cfg, "train"), **quiet}
    # the rollout node holds 2 workers of 1 CPU (g6e.12xlarge: 4 GPUs / rollout.ep_size 2)
    rollout = {"num_cpus": 2, "resources": node_resources(cfg, "rollout"), **quiet}
    # the head stands for the memory group (the exchange, the Ray head) and has a spare CPU

    def start():  # the three nodes, again from scratch if a raylet misses Ray's 30 s on a loaded host
        cl = Cluster(initialize_head=True, head_node_args={**head, "include_dashboard": False})
        return cl, {"memory": cl.head_node, "train": cl.add_node(**train), "rollout": cl.add_node(**rollout)}

    cl, nodes = retry_ray_start(start, num_attempts=2, what="the test's 3-node Ray cluster")
    ray.init(address=cl.address, configure_logging=False, log_to_driver=False)
    cl.wait_for_nodes()
    yield cfg, {name: node.node_id for name, node in nodes.items()}
    ray.shutdown()
    cl.shutdown()


def test_each_actor_lands_on_its_groups_node(cluster):
    cfg, node_of = cluster
    assert ray.cluster_resources()["train"] == cfg.cluster.train.gpus_per_node
    # trainer ranks ask for one CPU (standing in for their GPU) and the train resource
    ranks = [Probe.options(num_cpus=1, resources=actor_resources("train")).remote() for _ in range(2)]
    workers = [Probe.options(num_cpus=1, resources=_labels("rollout")).remote() for _ in range(2)]
    exchange = Probe.options(num_cpus=0, resources=actor_resources("memory")).remote()
    assert set(ray.get([a.node.remote() for a in ranks])) == {node_of["train"]}
    assert set(ray.get([a.node.remote() for a in workers])) == {node_of["rollout"]}
    assert ray.get(exchange.node.remote()) == node_of["memory"]
    # the train and rollout nodes are full; the head has a free CPU, and still neither spills onto it
    third_rank = Probe.options(num_cpus=1, resources=actor_resources("train")).remote()
    extra = Probe.options(num_cpus=1, resources=_labels("rollout")).remote()
    ready, _ = ray.wait([third_rank.node.remote(), extra.node.remote()], num_returns=2, timeout=3.0)
    assert ready == [] and ray.available_resources().get("CPU", 0) >= 1
    ray.kill(workers[0])
    ray.kill(ranks[0])
    assert ray.get(extra.node.remote(), timeout=60) == node_of["rollout"]
    assert ray.get(third_rank.node.remote(), timeout=60) == node_of["train"]
    for actor in [*ranks[1:], *workers[1:], exchange, extra, third_rank]:
        ray.kill(actor)


def test_scaling_hint_requests_rollout_capacity_from_the_autoscaler(cluster):
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    cfg, _ = cluster
    capacity = RolloutCapacity.for_ray(
        gpus_per_worker=cfg.rollout.ep_size,
        min_workers=cfg.fleet.min_workers,
        max_workers=cfg.fleet.max_workers,
    )
    assert capacity is not None

    def requested():
        return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))

    assert capacity.update(3) == 3  # a real request_resources call on the connected Ray
    assert requested() == [{"CPU": 1.0, "rollout": 0.001, "GPU": 2.0}] * 3
    assert capacity.update(3) is None and capacity.num_requests == 1  # unchanged hint: no new request
    assert capacity.update(100) == cfg.fleet.max_workers == len(requested())  # clamped to the group's max
    assert capacity.update(0) == cfg.fleet.min_workers == len(requested())  # released down to the min
    assert RolloutCapacity.for_ray(gpus_per_worker=0, min_workers=0, max_workers=1, request=print).bundle == {
        "CPU": 1.0,
        "rollout": 0.001,
    }


def test_trainer_rank_group_is_placed_on_the_train_node_only(cluster):
    """The trainer group's own placement (``moerl.trainer.distributed.ray_ranks``: its bundle, a PACK placement
    group) puts every rank on the train node; a group larger than the train node waits, never spilling."""
    from dataclasses import replace

    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from moerl.trainer.distributed.ray_ranks import _bundle

    cfg, node_of = cluster
    cfg = replace(cfg, model=replace(cfg.model, device="cpu"))  # no GPUs on these fake nodes: CPU bundles
    bundle = _bundle(cfg, 2)
    assert bundle.get("train") == 0.001  # moerl.cluster.placement.trainer_rank_resources
    pg = placement_group([bundle] * 2, strategy="PACK")
    assert ray.get(pg.ready(), timeout=60)
    ranks = [
        Probe.options(
            num_cpus=bundle["CPU"],
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        ).remote()
        for r in range(2)
    ]
    assert set(ray.get([a.node.remote() for a in ranks])) == {node_of["train"]}
    too_big = placement_group([{"CPU": 1.0, "train": 0.001}] * 3, strategy="PACK")  # train node: 2 CPUs
    ready, _ = ray.wait([too_big.ready()], timeout=3.0)
    assert ready == []
    remove_placement_group(too_big)
    for actor in ranks:
        ray.kill(actor)
    remove_placement_group(pg)


def test_exchange_without_its_resource_is_pinned_to_the_drivers_node(cluster):
    """On a cluster without the ``exchange`` resource the exchange is pinned (hard node affinity) to the
    driver's node; the pin holds on any node asked for, never spilling to one with free CPUs."""
    from moerl.cluster.placement import exchange_placement

    _, node_of = cluster
    without = {k: v for k, v in ray.cluster_resources().items() if k != "exchange"}
    driver = ray.get_runtime_context().get_node_id()
    exchange = Probe.options(num_cpus=0, **exchange_placement(without, driver).ray_options()).remote()
    assert ray.get(exchange.node.remote(), timeout=60) == driver
    for name in ("train", "rollout"):  # the pin is what decides: any node asked for is the one used
        probe = Probe.options(num_cpus=0, **exchange_placement(without, node_of[name]).ray_options()).remote()
        assert ray.get(probe.node.remote(), timeout=60) == node_of[name]
        ray.kill(probe)
    ray.kill(exchange)
