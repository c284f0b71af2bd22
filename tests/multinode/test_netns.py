"""The namespaced-cluster harness itself: nodes reach each other over the bridge, a cut partitions a node
and a restore heals it with its processes alive, a rate shape caps throughput, teardown leaves nothing, and
leftovers of a crashed run (a dead creator pid) are removed at the next start."""

import os
import subprocess
import sys
import time

from netns import PREFIX, Cluster, LinkShape, clean_leftovers

# A TCP sink that prints how many bytes it got and the moment it had them all, and a source that sends N
# bytes and prints the moment it connected (run inside namespaces; CLOCK_MONOTONIC is the host's in each,
# so the two moments bound the transfer alone, not the interpreters' start on a loaded host).
SINK = (
    "import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind((sys.argv[1],int(sys.argv[2]))); s.listen(); print('ready',flush=True); c,_=s.accept(); n=0\n"
    "while True:\n b=c.recv(1<<16)\n if not b: break\n n+=len(b)\nprint(n,time.monotonic(),flush=True)"
)
SOURCE = (
    "import socket,sys,time; c=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
    "timeout=float(sys.argv[4])); print(time.monotonic(),flush=True); c.sendall(b'x'*int(sys.argv[3])); c.close()"
)


def _send(c: Cluster, src: int, dst: int, nbytes: int, timeout_s: float = 10.0) -> tuple[int, float]:
    """Send ``nbytes`` from node ``src`` to node ``dst`` over TCP; (bytes received, seconds from the sender's
    connection to the receiver having them all), or (-1, seconds waited) when the sender fails."""
    addr = c.node(dst).addr
    sink = c.popen(dst, [sys.executable, "-c", SINK, addr, "7001"], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    r = c.run(
        src, [sys.executable, "-c", SOURCE, addr, "7001", str(nbytes), str(timeout_s)], timeout=timeout_s + 5
    )
    if r.returncode != 0:  # could not connect / send in time: the sink never gets a connection
        sink.kill()
        sink.wait(timeout=5)
        return -1, time.monotonic() - t0
    got, done = sink.stdout.readline().split()  # printed once the receiver has every byte
    sink.wait(timeout=5)
    # until delivery (the sender's sendall returns once its socket buffer holds the rest)
    return int(got), float(done) - float(r.stdout.split()[0])


def test_nodes_cut_restore_shape_and_teardown(make_cluster):
    c = make_cluster(3, head_in_root=True)
    assert c.node(0).ns is None and c.node(1).ns and c.node(2).ns
    assert _send(c, 1, 2, 100_000)[0] == 100_000  # namespace to namespace
    assert _send(c, 0, 1, 100_000)[0] == 100_000  # root namespace (the head) to a namespace

    # a cut node: nothing reaches it, a process inside stays alive, and the restore heals the link
    sleeper = c.popen(2, ["sleep", "60"])
    c.cut(2)
    assert _send(c, 1, 2, 1000, timeout_s=1.5)[0] == -1
    assert sleeper.poll() is None
    c.restore(2)
    assert _send(c, 1, 2, 1000)[0] == 1000

    # a 16 Mbit/s link: 2 MB takes >= 1 s (unshaped it takes a few ms)
    c.shape(1, LinkShape(rate_mbit=16))
    n, secs = _send(c, 1, 2, 2_000_000, timeout_s=20)
    assert n == 2_000_000 and secs >= 0.8, secs
    sent, _ = c.link_bytes(1)
    assert sent >= 2_000_000
    c.shape(1, LinkShape())
    assert _send(c, 1, 2, 2_000_000)[1] < 0.8

    assert c.node_pids(2)  # the sleeper
    assert c.kill_node(2) >= 1
    sleeper.wait(timeout=5)

    c.close()
    assert c.leftovers() == []
    assert not [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith(c.tag)
    ]
    assert not os.path.exists(c.scratch)


def test_leftovers_of_a_dead_creator_are_removed(netns_ok):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the "crashed earlier run"
    ns, link = f"{PREFIX}{dead.pid}n0", f"{PREFIX}{dead.pid}br"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
    mine = f"{PREFIX}{os.getpid()}zz"  # a live creator's link (this process): left alone
    subprocess.run(["ip", "link", "add", mine, "type", "bridge"], check=True)
    try:
        removed = clean_leftovers()
        assert ns in removed and link in removed and mine not in removed
        assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        for cmd in (["ip", "netns", "del", ns], ["ip", "link", "del", link], ["ip", "link", "del", mine]):
            subprocess.run(cmd, capture_output=True)


def test_link_shape_rejects_bad_values():
    import pytest

    for bad in (dict(rate_mbit=0), dict(delay_ms=-1), dict(loss_pct=101)):
        with pytest.raises(ValueError, match="LinkShape"):
            LinkShape(**bad)
