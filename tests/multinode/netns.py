"""A miniature cluster on one Linux host: each "node" a network namespace joined to one bridge by a veth
pair, with its own address, its link shaped by ``tc`` and cut/restored at will, and the root namespace
optionally joining as the head node through its own veth.

    with Cluster(nodes=3, head_in_root=True) as c:      # node 0 = root namespace (the head)
        c.shape(1, LinkShape(rate_mbit=100))            # node 1's link: 100 Mbit/s each way
        p = c.popen(2, ["ray", "start", "--block", ...]) # a process inside node 2's namespace
        c.cut(1); ...; c.restore(1)                     # a partition: processes stay alive

Names: every namespace, bridge and veth is called ``mrln<pid>...`` (``pid`` = the creating process), so a
run removes the leftovers of a crashed earlier one (whose ``pid`` is no longer alive) and never touches
those of a concurrent one. Addresses: one ``10.251.X.0/24`` with ``X`` chosen so that the subnet is on no
interface or route of the root namespace. Teardown (``close``) kills every process started through the
cluster (with their descendants), every process still inside one of its namespaces (``ip netns pids``) and
every root-namespace process whose command line names the cluster's scratch folder (Ray's ``--temp-dir``),
then removes qdiscs, veths, the bridge and the namespaces. It runs on ``__exit__``, at interpreter exit
(``atexit``) and from the pytest fixture finalizer; it is idempotent.

Link shaping uses what the kernel has: rate through ``tbf`` (always built where ``tc`` works here), delay and
loss through ``netem`` where the kernel has ``sch_netem`` (``netem_available()``); asking for delay or loss
without it raises ``LinkShapeUnsupported`` naming the missing module. A cut sets the node's host-side veth
down (the peer loses carrier; no packet passes either way) which works on any kernel.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from moerl.processes import cmdline, descendants, is_gone

PREFIX = "mrln"  # every namespace / link this harness creates starts with it (then the creator's pid)


class LinkShapeUnsupported(RuntimeError):
    """The kernel lacks the ``tc`` qdisc a requested link shape needs (e.g. ``sch_netem`` for delay/loss)."""


def skip_reason() -> str | None:
    """Why namespaced clusters cannot be built here (not root, no ``ip``/``tc``, no ``ip netns``, no veth or
    bridge support), or None when they can. Tests call ``pytest.skip(reason)`` with it."""
    if os.geteuid() != 0:
        return "multinode tests need root (network namespaces, veth, bridge, tc); run them as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"multinode tests need `{tool}` (iproute2) on PATH"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` is unavailable here: {r.stderr.strip() or r.returncode}"
    probe = f"{PREFIX}{os.getpid()}pr"
    r = subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a bridge interface here: {r.stderr.strip()}"
    subprocess.run(["ip", "link", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command (inside namespace ``ns`` when given); raise with its stderr on failure."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    r = subprocess.run(full, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(full)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


_netem: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has the ``netem`` qdisc (delay, loss); probed once on a throwaway veth pair."""
    global _netem
    if _netem is None:
        a, b = f"{PREFIX}{os.getpid()}qa", f"{PREFIX}{os.getpid()}qb"
        _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        try:
            _netem = (
                _sh("tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "1ms", check=False).returncode
                == 0
            )
        finally:
            _sh("ip", "link", "del", a, check=False)
    return _netem


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """How one node's link to the bridge is shaped, applied to both directions (egress of each veth end).

    rate_mbit: bandwidth cap in Mbit/s (``tbf``), None for none. delay_ms: one-way added latency in
    milliseconds (``netem``). loss_pct: random packet loss in percent, 0..100 (``netem``).
    Raises ValueError on a negative value or a loss above 100.
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self):
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"LinkShape.rate_mbit must be > 0 Mbit/s or None, got {self.rate_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"LinkShape.delay_ms must be >= 0 ms, got {self.delay_ms}")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"LinkShape.loss_pct must be in [0, 100] percent, got {self.loss_pct}")

    def tc_args(self) -> list[list[str]]:
        """The ``tc qdisc add dev DEV ...`` argument lists (after ``dev DEV``) that build this shape.
        Raises LinkShapeUnsupported when delay/loss are asked for and the kernel has no ``netem``."""
        netem = []
        if self.delay_ms:
            netem += ["delay", f"{self.delay_ms}ms"]
        if self.loss_pct:
            netem += ["loss", f"{self.loss_pct}%"]
        if netem and not netem_available():
            raise LinkShapeUnsupported(
                f"link delay/loss need the netem qdisc (kernel module sch_netem), which this kernel lacks: {self}"
            )
        rate = []
        if self.rate_mbit is not None:
            burst = max(
                16_000, int(self.rate_mbit * 1e6 / 8 / 250)
            )  # >= one timer tick (4 ms) worth of bytes
            rate = ["rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]
        if netem and rate:
            return [
                ["root", "handle", "1:", "netem", *netem],
                ["parent", "1:1", "handle", "10:", "tbf", *rate],
            ]
        if netem:
            return [["root", "handle", "1:", "netem", *netem]]
        if rate:
            return [["root", "handle", "1:", "tbf", *rate]]
        return []


@dataclass(slots=True)
class Node:
    """One node of a ``Cluster``. index: 0.. in creation order. ns: its namespace name, or None for the
    root namespace (the head, when ``head_in_root``). addr: its IPv4 address on the bridge (str).
    host_if / node_if: its veth ends, in the root namespace / in its own namespace."""

    index: int
    ns: str | None
    addr: str
    host_if: str
    node_if: str

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this node's namespace (unchanged for the root one)."""
        return (["ip", "netns", "exec", self.ns] if self.ns else []) + list(argv)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    """The creator pid in a harness name ``mrln<pid><suffix>``, or None for a name not of this harness."""
    if not name.startswith(PREFIX):
        return None
    digits = ""
    for ch in name[len(PREFIX) :]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _netns_names() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _sh("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_all(pids: set[int], grace_s: float = 3.0) -> None:
    """SIGTERM then, after ``grace_s`` seconds, SIGKILL the given pids (never this process)."""
    pids = {p for p in pids if p != os.getpid() and p > 1}
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        live = [p for p in pids if _alive(p)]
        for p in live:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(not is_gone(p) for p in live):
            time.sleep(0.05)


def clean_leftovers() -> list[str]:
    """Remove namespaces and links of this harness whose creator process is dead (a crashed earlier run),
    killing the processes still inside those namespaces first. Returns the names removed."""
    removed = []
    for ns in _netns_names():
        owner = _owner_pid(ns)
        if owner is None or _alive(owner):
            continue
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        _kill_all({int(p) for p in pids if p.isdigit()}, grace_s=1.0)
        _sh("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    for link in _link_names():
        owner = _owner_pid(link)
        if owner is None or _alive(owner):
            continue
        if _sh("ip", "link", "del", link, check=False).returncode == 0:
            removed.append(link)
    return removed


def free_subnet(second: int = 251) -> ipaddress.IPv4Network:
    """A ``10.<second>.X.0/24`` that overlaps no address or route of the root namespace. Raises
    RuntimeError when all 256 are taken."""
    used = []
    for cmd in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for tok in _sh(*cmd, check=False).stdout.split():
            try:
                used.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                continue
    start = os.getpid() % 256  # concurrent harnesses start apart
    for k in range(256):
        net = ipaddress.ip_network(f"10.{second}.{(start + k) % 256}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free 10.{second}.X.0/24 subnet in the root namespace's addresses and routes")


class Cluster:
    """``nodes`` namespaced nodes on one bridge (see the module docstring). With ``head_in_root`` node 0
    is the root namespace itself, joined to the bridge through its own veth; the others are namespaces.

    nodes: number of nodes (>= 1, <= 50). subnet: the /24 to use (default: ``free_subnet()``).
    Raises ValueError on a bad node count, RuntimeError (with the failing command) when building fails;
    a partly built cluster is torn down before the error propagates.
    """

    def __init__(
        self, nodes: int, *, head_in_root: bool = False, subnet: ipaddress.IPv4Network | None = None
    ):
        if not 1 <= nodes <= 50:
            raise ValueError(f"Cluster nodes must be in 1..50, got {nodes}")
        self.tag = f"{PREFIX}{os.getpid()}"
        # one Cluster at a time per process (names carry only the pid); a second would collide on names
        self.bridge = f"{self.tag}br"
        self.n, self.head_in_root = nodes, head_in_root
        self.subnet = subnet or free_subnet()
        hosts = list(self.subnet.hosts())
        self.nodes = [
            Node(
                index=i,
                ns=None if (head_in_root and i == 0) else f"{self.tag}n{i}",
                addr=str(hosts[i + 1]),
                host_if=f"{self.tag}h{i}",
                node_if=f"{self.tag}p{i}",
            )
            for i in range(nodes)
        ]
        self.scratch = tempfile.mkdtemp(prefix=f"{self.tag}_")
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._built = False
        atexit.register(self.close)

    # ---- building ----
    def __enter__(self) -> Cluster:
        self.build()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> Cluster:
        """Create bridge, namespaces, veths and addresses (after ``clean_leftovers()``). Idempotent."""
        if self._built:
            return self
        clean_leftovers()
        self._built = True
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            plen = self.subnet.prefixlen
            for nd in self.nodes:
                _sh("ip", "link", "add", nd.host_if, "type", "veth", "peer", "name", nd.node_if)
                _sh("ip", "link", "set", nd.host_if, "master", self.bridge)
                _sh("ip", "link", "set", nd.host_if, "up")
                if nd.ns:
                    _sh("ip", "netns", "add", nd.ns)
                    _sh("ip", "link", "set", nd.node_if, "netns", nd.ns)
                    _sh("ip", "link", "set", "lo", "up", ns=nd.ns)
                _sh("ip", "addr", "add", f"{nd.addr}/{plen}", "dev", nd.node_if, ns=nd.ns)
                _sh("ip", "link", "set", nd.node_if, "up", ns=nd.ns)
        except BaseException:
            self.close()
            raise
        return self

    def node(self, i: int) -> Node:
        """Node ``i``; raises IndexError naming the node count when out of range."""
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} out of range: the cluster has {self.n} nodes (0..{self.n - 1})")
        return self.nodes[i]

    # ---- processes ----
    def run(self, i: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside node ``i`` (``subprocess.run`` keywords pass through)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.node(i).argv(argv), **kw)

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``i`` in a new session; it and its descendants die at ``close``."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.node(i).argv(argv), **kw)
        self._procs.append(p)
        return p

    def node_pids(self, i: int) -> set[int]:
        """Pids of every process inside node ``i``'s namespace (empty for the root-namespace node)."""
        nd = self.node(i)
        if nd.ns is None:
            return set()
        return {int(p) for p in _sh("ip", "netns", "pids", nd.ns, check=False).stdout.split() if p.isdigit()}

    def kill_node(self, i: int) -> int:
        """SIGKILL every process inside node ``i`` at once (a whole node lost); returns how many.
        Raises ValueError for the root-namespace node (that would kill the test itself)."""
        if self.node(i).ns is None:
            raise ValueError(f"node {i} is the root namespace; killing all its processes would kill the test")
        pids = self.node_pids(i)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        return len(pids)

    # ---- links ----
    def shape(self, i: int, shape: LinkShape) -> None:
        """Shape node ``i``'s link both ways (replacing any earlier shape); ``LinkShape()`` clears it."""
        nd = self.node(i)
        for dev, ns in ((nd.host_if, None), (nd.node_if, nd.ns)):
            _sh("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            for args in shape.tc_args():
                _sh("tc", "qdisc", "add", "dev", dev, *args, ns=ns)

    def cut(self, i: int) -> None:
        """Partition node ``i``: no packet passes its link either way; its processes keep running."""
        _sh("ip", "link", "set", self.node(i).host_if, "down")

    def restore(self, i: int) -> None:
        """Undo ``cut(i)``."""
        _sh("ip", "link", "set", self.node(i).host_if, "up")

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(bytes sent by node ``i``, bytes received by node ``i``) over its link so far, from the
        host-side veth counters (what the host end receives is what the node sent)."""
        base = f"/sys/class/net/{self.node(i).host_if}/statistics"
        with open(f"{base}/rx_bytes") as f:
            sent = int(f.read())
        with open(f"{base}/tx_bytes") as f:
            recv = int(f.read())
        return sent, recv

    # ---- teardown ----
    def _own_root_pids(self) -> set[int]:
        """Root-namespace processes this cluster owns: started through ``popen`` (and descendants), or
        naming its scratch folder on their command line (Ray daemons started with ``--temp-dir`` in it)."""
        roots = {p.pid for p in self._procs}
        roots |= {
            int(d) for d in os.listdir("/proc") if d.isdigit() and self.scratch in " ".join(cmdline(int(d)))
        }
        return roots | descendants(*roots) if roots else set()

    def close(self) -> None:
        """Kill every process of the cluster and remove qdiscs, veths, bridge, namespaces and the scratch
        folder. Idempotent; never raises (a failing step is skipped so the rest still runs)."""
        if self._closed:
            return
        self._closed = True
        pids = self._own_root_pids()
        for nd in self.nodes:
            if nd.ns and nd.ns in _netns_names():
                pids |= {
                    int(p)
                    for p in _sh("ip", "netns", "pids", nd.ns, check=False).stdout.split()
                    if p.isdigit()
                }
        _kill_all(pids)
        for p in self._procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        for nd in self.nodes:
            _sh("tc", "qdisc", "del", "dev", nd.host_if, "root", check=False)
            _sh("ip", "link", "del", nd.host_if, check=False)  # removes the peer too (also inside a netns)
            if nd.ns:
                _sh("ip", "netns", "del", nd.ns, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Names of this cluster's namespaces/links still present and its processes still alive (for the
        tests' no-leftovers check); empty after ``close``."""
        names = [n for n in _netns_names() + _link_names() if n.startswith(self.tag)]
        return names + [f"pid {p}" for p in self._own_root_pids() if not is_gone(p)]
