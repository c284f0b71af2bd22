"""Expert parallelism: topology, expert placement, dispatch layout, and the ``Dispatcher`` interface with
two backends registered in ``DISPATCHERS`` (flat all-to-all baseline, topology-aware hierarchical).
See README.md in this folder."""

from moerl.ep.alltoall import AllToAllDispatcher
from moerl.ep.collective import CollectiveDispatcher, RowHandle
from moerl.ep.comm import EPInputError
from moerl.ep.dispatcher import Dispatcher, DispatcherBuilder, DispatchHandle
from moerl.ep.hierarchical import HierarchicalDispatcher
from moerl.ep.layout import Layout, Traffic, compute_layout
from moerl.ep.placement import ExpertPlacement, node_limited_topk, sample_node_limited_routing
from moerl.ep.registry import DISPATCHERS, build_dispatcher
from moerl.ep.topology import Topology, TopologyGroups

__all__ = [
    "DISPATCHERS",
    "AllToAllDispatcher",
    "CollectiveDispatcher",
    "DispatchHandle",
    "Dispatcher",
    "DispatcherBuilder",
    "EPInputError",
    "ExpertPlacement",
    "HierarchicalDispatcher",
    "Layout",
    "RowHandle",
    "Topology",
    "TopologyGroups",
    "Traffic",
    "build_dispatcher",
    "compute_layout",
    "node_limited_topk",
    "sample_node_limited_routing",
]
