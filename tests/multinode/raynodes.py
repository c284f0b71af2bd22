"""A real Ray cluster on a ``netns.Cluster``: one ``ray start`` per node (the head on node ``head``), each
with its node group's custom resources (``train``, ``rollout``, ``exchange``, ``env``), every process of it
torn down with the cluster (``Cluster.close``).

    ray = RayNodes(c, {0: {"train": 1, "exchange": 1}, 1: {"rollout": 1}}, cpus={0: 2, 1: 1})
    ray.start()                          # waits until every node is alive
    c.popen(0, [*ray.python, "-m", "moerl.cli", "train", "--ray-address", ray.address, ...], env=ray.env)

Token authentication is turned off (``RAY_AUTH_MODE=disabled``: the nodes and the driver share no token
file in the test), usage stats too. ``env`` carries ``PYTHONPATH`` of the test process, so every node's
workers import the same moerl as the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from netns import Cluster

READY = "This command will now block forever"  # what `ray start --block` prints once the node runs
PORT = 6379
HEALTH_CHECK_FAILURES = 12  # the GCS port inside the head's namespace: each namespace has its own ports

WAIT_NODES = """
import ray, sys, time
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"only {sum(n['Alive'] for n in ray.nodes())} of {sys.argv[2]} Ray nodes alive")
    time.sleep(0.5)
"""

# prints the addresses the GCS counts alive, after waiting (up to argv[2] s) until none of argv[3:] is
WAIT_DEAD = """
import json, ray, sys, time
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[2])
alive = lambda: {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
while alive() & set(sys.argv[3:]) and time.monotonic() < deadline:
    time.sleep(0.5)
print(json.dumps(sorted(alive())))
"""


class RayNodes:
    """Ray on the nodes of ``cluster``: ``resources`` maps node index -> custom resources of its
    ``ray start``; ``cpus`` node index -> ``--num-cpus`` (default 1); ``head``: the head's node index
    (must be in ``resources``). Raises ValueError when ``head`` is not one of the nodes started."""

    def __init__(self, cluster: Cluster, resources: dict[int, dict[str, float]], *, cpus=None, head: int = 0):
        if head not in resources:
            raise ValueError(f"head node {head} is not among the nodes to start: {sorted(resources)}")
        self.c, self.resources, self.head = cluster, resources, head
        self.cpus = {i: 1 for i in resources} | dict(cpus or {})
        self.address = f"{cluster.node(head).addr}:{PORT}"
        self.python = [sys.executable]
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.env = dict(
            os.environ,
            RAY_AUTH_MODE="disabled",
            RAY_USAGE_STATS_ENABLED="0",
            # a node is declared dead after this many missed 3 s health checks (Ray's default 5): on shared,
            # overloaded test cores healthy raylets missed 5 and were killed; a node killed or cut off for
            # longer (~45 s) is still declared dead
            RAY_health_check_failure_threshold=str(HEALTH_CHECK_FAILURES),
            PYTHONPATH=os.environ.get("PYTHONPATH", "") + os.pathsep + path,
        )
        self.env.pop("RAY_ADDRESS", None)
        self._procs: dict[int, subprocess.Popen] = {}  # node index -> its (latest) `ray start --block`
        self.logs = os.path.join(cluster.scratch, "ray-logs")
        os.makedirs(self.logs, exist_ok=True)

    def _start(self, i: int, head: bool) -> subprocess.Popen:
        argv = [
            "ray", "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.c.node(i).addr}",
            f"--num-cpus={self.cpus[i]}", "--num-gpus=0",
            "--resources", json.dumps(self.resources[i]),
        ]  # fmt: skip
        if head:
            # the temp dir names the cluster's scratch folder: teardown finds a root-namespace head by it
            argv += ["--head", f"--port={PORT}", "--include-dashboard=false",
                     f"--temp-dir={self.c.scratch}/ray"]  # fmt: skip
        else:
            # the nodes share one host and so one session folder (the head's): one log monitor, the head's,
            # reads every node's worker logs; one on each node read the same files again (each of the six
            # used more CPU than its raylet: 154 CPU-s of the module's Ray daemons by mid-run) and sent the
            # driver each line once per node. Ray: "Only one log monitor should be started per physical host"
            argv += [f"--address={self.address}", "--include-log-monitor=False"]
        log = open(os.path.join(self.logs, f"node{i}.log"), "w")
        # gloo (trainer ranks, EP groups) binds the interface named here, else the one the hostname
        # resolves to, which a namespace does not have; Ray's workers inherit the node's environment
        env = dict(self.env, GLOO_SOCKET_IFNAME=self.c.node(i).node_if)
        return self.c.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 240.0) -> RayNodes:
        """Start the head, then the other nodes one at a time (on loaded cores a raylet that does not
        register within Ray's fixed 30 s gives up: each start is retried; five started at once on the
        loaded 2-core machine failed so three times), then wait until all are alive.
        Raises RuntimeError (with the node logs' tails) when that takes over ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        self._join(self.head, head=True, deadline=deadline)
        for i in self.resources:
            if i != self.head:
                self._join(i, head=False, deadline=deadline)
        self._wait_alive(deadline)
        return self

    def _wait_alive(self, deadline: float) -> None:
        left = max(10.0, deadline - time.monotonic())
        r = self.c.run(
            self.head, [sys.executable, "-c", WAIT_NODES, self.address, str(len(self.resources)), str(left)],
            env=self.env, timeout=left + 60,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"Ray nodes did not all join: {r.stderr.strip()[-500:]} {self.log_tails()}")

    def heal(self, timeout_s: float = 240.0, *, restart: bool = True) -> list[int]:
        """Give the next run the whole cluster: every node whose ``ray start`` exited (killed, or its raylet
        stopped after the GCS declared it dead) or that the GCS no longer counts alive is cleared (what is
        left in its namespace killed), waited for until the GCS has declared it dead -- before that, Ray
        still places actors on a killed node, and a run's exchange placed there never starts -- and, with
        ``restart``, started again (without, the next run gets only the nodes really alive). Returns those
        nodes. Raises RuntimeError as ``start`` does."""
        deadline = time.monotonic() + timeout_s
        alive = self._alive_addresses(deadline, dead=[])
        down = [
            i for i in self.resources
            if i != self.head and (self._procs[i].poll() is not None or self.c.node(i).addr not in alive)
        ]  # fmt: skip
        if not down:
            return []
        for i in down:
            self.c.kill_node(i)
        if {self.c.node(i).addr for i in down} & self._alive_addresses(deadline, dead=down):
            raise RuntimeError(f"Ray nodes {down} killed but not declared dead in {timeout_s:.0f} s")
        if not restart:
            return down
        for i in down:
            self._join(i, head=False, deadline=deadline)
        self._wait_alive(deadline)
        return down

    def _alive_addresses(self, deadline: float, dead: list[int]) -> set[str]:
        """The addresses of the nodes the GCS counts alive, once it no longer counts ``dead`` among them
        or at ``deadline``."""
        left = max(10.0, deadline - time.monotonic())
        argv = [
            sys.executable,
            "-c",
            WAIT_DEAD,
            self.address,
            str(left),
            *(self.c.node(i).addr for i in dead),
        ]
        r = self.c.run(self.head, argv, env=self.env, timeout=left + 60)
        if r.returncode != 0:
            raise RuntimeError(f"cannot read the Ray node table: {r.stderr.strip()[-500:]}")
        return set(json.loads(r.stdout.strip().splitlines()[-1]))

    def _join(self, i: int, *, head: bool, deadline: float, attempts: int = 3) -> None:
        """Start node ``i`` and wait until its ``ray start`` reports it running; a start that exits is
        retried (``attempts`` in all) after what it left in the node's namespace is killed."""
        log = os.path.join(self.logs, f"node{i}.log")
        for attempt in range(attempts):
            self._procs[i] = self._start(i, head=head)
            if self._ready(i, deadline):
                return
            if time.monotonic() > deadline:
                break
            os.replace(log, f"{log}.failed{attempt}")
            if self.c.node(i).ns is not None:
                self.c.kill_node(i)
                time.sleep(1.0)
        raise RuntimeError(f"Ray node {i} did not start: {self.log_tails()}")

    def _ready(self, i: int, deadline: float) -> bool:
        """Wait until node ``i``'s ``ray start`` reports it running (True), exits or the deadline passes."""
        log = os.path.join(self.logs, f"node{i}.log")
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                if READY in f.read():
                    return True
            if self._procs[i].poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def log_tails(self, n: int = 400) -> str:
        """The last ``n`` characters of each node's ``ray start`` log (for error messages)."""
        out = []
        for name in sorted(os.listdir(self.logs)):
            with open(os.path.join(self.logs, name), errors="replace") as f:
                out.append(f"[{name}] {f.read()[-n:]}")
        return " ".join(out)
