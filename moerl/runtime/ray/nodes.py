"""Node loss as an event of the run: ``NodeWatch`` reads Ray's node table and reports each node that was
alive and is now dead (killed, or partitioned past Ray's health check), once.

``RayRollouts`` polls it at its fleet checks; each loss is logged as one line naming the node's address and
its node-group resources, and counted in ``fleet/nodes_lost`` (``metrics.jsonl``). The workers of the node
are handled by the fleet as usual (declared crashed, their leases expired, replaced).
"""

from __future__ import annotations

import time
from collections.abc import Callable

GROUP_RESOURCES = ("train", "rollout", "exchange", "env")
"""The custom resources named in a loss line (``moerl.cluster.resources``)."""


def node_address() -> str:
    """This process's Ray node, as its IP address; "" outside a connected Ray process (tests build the
    actors in-process)."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else ""
    except Exception:  # no Ray installed or not connected: the node is unknown
        return ""


def _ray_nodes() -> list[dict]:
    import ray  # lazy: only async mode imports Ray

    return ray.nodes()


class NodeWatch:
    """Ray nodes lost during the run.

    Args:
        nodes: the node table, ``ray.nodes()``'s form (dicts with ``NodeID``, ``Alive``,
            ``NodeManagerAddress``, ``Resources``); injectable in tests.
        every_s: seconds between two reads of the table (it is one GCS round trip).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        nodes: Callable[[], list[dict]] = _ray_nodes,
        *,
        every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._nodes, self.every_s, self.clock = nodes, every_s, clock
        self._alive: dict[str, list[str]] = {}  # node id -> its node groups, seen while it was alive
        self.lost: dict[str, str] = {}
        """Node id -> its address, for every node seen alive and then dead, in the order lost."""
        self._next = 0.0

    def poll(self) -> list[str]:
        """Read the node table (at most every ``every_s``); one line per node lost since the last read.
        A failed read (the GCS busy) is skipped: the next poll sees the loss."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        try:
            table = self._nodes()
        except Exception:  # the GCS did not answer: try again at the next poll
            return []
        lines = []
        for n in table:
            nid = n.get("NodeID", "")
            if n.get("Alive"):
                self._alive[nid] = [g for g in GROUP_RESOURCES if g in (n.get("Resources") or {})]
            elif nid in self._alive and nid not in self.lost:
                groups = self._alive.pop(nid)  # a dead node's table entry lists no resources
                addr = n.get("NodeManagerAddress", "?")
                self.lost[nid] = addr
                lines.append(
                    f"Ray node {addr} lost (node groups: {', '.join(groups) or 'none'}; "
                    f"{len(self.lost)} lost so far): its actors are gone, its workers' leases expire and requeue"
                )
        return lines
