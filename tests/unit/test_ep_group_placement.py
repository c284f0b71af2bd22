"""Placement of a rollout EP group's followers (``moerl.runtime.ray.ep_group.follower_placement``, issue 34):
one node packs the followers on the leader's node; several nodes get one bundle per node (that node's
ranks packed), STRICT_SPREAD, the leader's node pinned, rank r on node r // G."""

import shutil
import subprocess

import pytest

from moerl.runtime.ray.ep_group import follower_placement, interface_of

RANK = {"CPU": 1.0, "GPU": 1.0, "rollout": 0.001}


def test_one_node_packs_on_the_leaders_node():
    bundles, strategy, where = follower_placement(4, 4, RANK, "node:10.0.0.1")
    assert strategy == "STRICT_PACK" and where == [0, 1, 2]
    assert bundles == [{**RANK, "node:10.0.0.1": 0.001}] * 3


def test_two_nodes_of_two_ranks():
    bundles, strategy, where = follower_placement(4, 2, RANK, "node:10.0.0.1")
    assert strategy == "STRICT_SPREAD"
    assert where == [0, 1, 1]  # rank 1 with the leader (node 0), ranks 2 and 3 on node 1
    assert bundles[0] == {"CPU": 1.0, "GPU": 1.0, "rollout": 0.001, "node:10.0.0.1": 0.001}
    assert bundles[1] == {"CPU": 2.0, "GPU": 2.0, "rollout": 0.002}  # not pinned: another node


def test_one_rank_per_node():
    bundles, strategy, where = follower_placement(3, 1, {"CPU": 1.0}, "node:a")
    assert strategy == "STRICT_SPREAD" and where == [1, 2]
    assert bundles == [{"node:a": 0.001}, {"CPU": 1.0}, {"CPU": 1.0}]  # the leader's own node: a marker only


@pytest.mark.parametrize("per_node", [0, 3, 5])
def test_bad_layouts(per_node):
    with pytest.raises(ValueError, match=f"EP ranks per node {per_node} must divide the group's 4 ranks"):
        follower_placement(4, per_node, RANK, "node:a")


def test_gloo_finds_the_interface_of_the_node_address():
    """A rank's gloo listens on the interface of its Ray node's address (a node may be multi-homed)."""
    if shutil.which("ip") is None:
        pytest.skip("needs `ip` (iproute2) to list the addresses")
    listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    pairs = [(line.split()[1], line.split()[3].split("/")[0]) for line in listed.splitlines()]
    assert pairs
    for name, addr in pairs:
        assert interface_of(addr) == name
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: on no interface here


def test_a_one_node_ray_cluster_simulates_the_nodes():
    bundles, strategy, where = follower_placement(4, 2, RANK, "node:10.0.0.1", simulated=True)
    assert strategy == "STRICT_PACK" and where == [0, 1, 2]
    assert bundles == [{**RANK, "node:10.0.0.1": 0.001}] * 3
