"""Expert parallelism: topology, expert placement, dispatch layout, and two dispatchers behind one
interface (flat all-to-all baseline, topology-aware hierarchical). See README.md in this folder."""

from moerl.ep.alltoall import AllToAllDispatcher
from moerl.ep.comm import EPInputError
from moerl.ep.dispatcher import Dispatcher, DispatchHandle
from moerl.ep.hierarchical import HierarchicalDispatcher
from moerl.ep.layout import Layout, Traffic, compute_layout
from moerl.ep.placement import ExpertPlacement, node_limited_topk, sample_node_limited_routing
from moerl.ep.topology import Topology, TopologyGroups

__all__ = [
    "AllToAllDispatcher",
    "DispatchHandle",
    "Dispatcher",
    "EPInputError",
    "ExpertPlacement",
    "HierarchicalDispatcher",
    "Layout",
    "Topology",
    "TopologyGroups",
    "Traffic",
    "compute_layout",
    "node_limited_topk",
    "sample_node_limited_routing",
]
