"""A new local Ray instance that survives a slow start on a loaded host.

``ray.init(address="local")`` starts the GCS, the raylet and their helpers, then waits a fixed 30 s
(``raylet_start_wait_time_s`` in ``ray/_private/node.py``, not configurable in Ray 2.x) for the raylet to
register; on a host whose cores are all busy (a CI machine running tests in parallel, a laptop compiling)
that wait can run out although nothing is broken, and Ray raises a bare ``Exception`` ("The current node
timed out during startup") leaving the processes it started running. ``retry_ray_start`` (and
``start_local_ray``, its ``ray.init`` form) kills exactly those processes (the descendants of this process
that appeared during the failed call and run Ray's binaries or workers) and starts again, up to
``attempts`` times. Linux only for the clean-up (``/proc``);
elsewhere the first timeout is raised as Ray raised it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_TIMEOUT = "timed out during startup"  # what Ray's Exception says when the raylet did not register


def _children_by_parent(proc: Path = Path("/proc")) -> dict[int, list[int]]:
    """Parent pid -> child pids of every process visible in ``proc`` (from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int | None = None) -> set[int]:
    """The pids of every live descendant of ``pid`` (default: this process); empty without ``/proc``."""
    if not Path("/proc/self/stat").exists():
        return set()
    tree = _children_by_parent()
    found: set[int] = set()
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a for a in raw.decode(errors="replace").split("\0") if a]


def is_ray_process(cmdline: list[str], ray_dir: str) -> bool:
    """Whether a process with this command line is one of Ray's: a binary or script under the Ray package
    folder ``ray_dir`` (gcs_server, raylet, monitor.py, log_monitor.py, dashboard.py, the reaper) or a
    worker, which renames itself ``ray::<name>``."""
    ray_dir = ray_dir.rstrip("/") + "/"
    return bool(cmdline) and (cmdline[0].startswith("ray::") or any(a.startswith(ray_dir) for a in cmdline))


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (absent, or a zombie waiting for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X")


def kill_new_ray_processes(before: set[int], ray_dir: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL the descendants of this process that are not in ``before`` and are Ray's
    (``is_ray_process``), then wait up to ``wait_s`` seconds for them to exit; returns their pids. A
    process that exited meanwhile is skipped."""
    killed = []
    for pid in sorted(descendants() - before):
        if is_ray_process(_cmdline(pid), ray_dir):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_gone(p) for p in killed):
        time.sleep(0.05)
    return killed


def retry_ray_start(start: Callable[[], T], attempts: int = 3, what: str = "Ray's local start") -> T:
    """Run ``start`` (anything that starts Ray nodes on this host: ``ray.init(address="local")``, a
    ``ray.cluster_utils.Cluster``) and return its result; when Ray's fixed 30 s wait for a raylet runs
    out (module docstring), kill the Ray processes that attempt started and run ``start`` again, up to
    ``attempts`` runs in all. After the last, its processes are killed too and Ray's error raised: nothing
    a failed start started is left running.

    Args:
        start: the starting call; called up to ``attempts`` times.
        attempts: runs to try (>= 1).
        what: names the start in the warning logged before each retry.

    Raises:
        ValueError: ``attempts`` < 1.
        Exception: Ray's own startup error, from the last attempt (or the first where ``/proc`` is absent);
            any other error of ``start`` at once.
    """
    import ray

    if attempts < 1:
        raise ValueError(f"retry_ray_start: attempts must be >= 1, got {attempts}")
    ray_dir = os.path.dirname(ray.__file__)
    can_clean = Path("/proc/self/stat").exists()
    for attempt in range(1, attempts + 1):
        before = descendants()
        t0 = time.monotonic()
        try:
            return start()
        except Exception as e:  # Ray raises a bare Exception for this one
            if STARTUP_TIMEOUT not in str(e) or not can_clean:
                raise
            killed = kill_new_ray_processes(before, ray_dir)
            if attempt == attempts:
                raise
            log.warning(
                "%s timed out after %.0f s (attempt %d of %d; its raylet did not register: host "
                "overloaded?): killed the %d processes it started, starting again",
                what,
                time.monotonic() - t0,
                attempt,
                attempts,
                len(killed),
            )
    raise AssertionError("unreachable")


def start_local_ray(attempts: int = 3, **init_kwargs) -> None:
    """``ray.init(address="local", **init_kwargs)``: a new local Ray instance, never another process's
    running cluster, started again when Ray's fixed 30 s wait for its raylet runs out (``retry_ray_start``).

    Args:
        attempts: starts to try (>= 1).
        init_kwargs: the rest of ``ray.init``'s arguments (``num_cpus``, ``include_dashboard``, ...);
            ``address`` is not accepted (this starts a local instance).

    Raises:
        ValueError: ``attempts`` < 1 or ``address`` given.
        Exception: as ``retry_ray_start``.
    """
    import ray

    if "address" in init_kwargs:
        raise ValueError(
            "start_local_ray starts a local instance: pass no address (use ray.init for a cluster)"
        )
    retry_ray_start(lambda: ray.init(address="local", **init_kwargs), attempts)
