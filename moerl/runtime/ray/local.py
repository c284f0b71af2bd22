"""A new local Ray instance that survives a slow start on a loaded host.

``ray.init(address="local")`` starts the GCS, the raylet and their helpers, then waits a fixed 30 s
(``raylet_start_wait_time_s`` in ``ray/_private/node.py``, not configurable in Ray 2.x) for the raylet to
register; on a host whose cores are all busy (a CI machine running tests in parallel, a laptop compiling)
that wait can run out although nothing is broken, and Ray raises a bare ``Exception`` ("The current node
timed out during startup") leaving the processes it started running. ``retry_ray_start`` (and
``start_local_ray``, its ``ray.init`` form) kills exactly those processes (the descendants of this process
that appeared during the failed call and run Ray's binaries or workers, read by ``moerl.processes``) and
starts again, up to ``num_attempts`` times. The clean-up reads ``/proc`` (Linux); elsewhere the first
timeout is raised as Ray raised it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from moerl.errors import RayStartError
from moerl.processes import HAS_PROC, cmdline, descendants, is_gone

log = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_TIMEOUT = "timed out during startup"  # what Ray's Exception says when the raylet did not register


def is_ray_process(cmdline: list[str], ray_dir: str) -> bool:
    """Whether a process with this command line is one of Ray's: a binary or script under the Ray package
    folder ``ray_dir`` (gcs_server, raylet, monitor.py, log_monitor.py, dashboard.py, the reaper) or a
    worker, which renames itself ``ray::<name>``."""
    ray_dir = ray_dir.rstrip("/") + "/"
    return bool(cmdline) and (cmdline[0].startswith("ray::") or any(a.startswith(ray_dir) for a in cmdline))


def kill_new_ray_processes(before: set[int], ray_dir: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL the descendants of this process that are not in ``before`` and are Ray's
    (``is_ray_process``), then wait up to ``wait_s`` seconds for them to exit (those still there are
    logged); returns their pids. A process that exited meanwhile is skipped. One reading of ``/proc``: a
    process Ray spawns after it is not killed here (Ray's children exit with the raylet that spawned them).
    """
    killed = []
    for pid in sorted(descendants() - before):
        if is_ray_process(cmdline(pid), ray_dir):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(is_gone(p) for p in killed):
        time.sleep(0.05)
    if left := [p for p in killed if not is_gone(p)]:
        log.warning("Ray processes %s still there %.0f s after SIGKILL", left, wait_s)
    return killed


def retry_ray_start(
    start: Callable[[], T],
    num_attempts: int = 3,
    what: str = "Ray's local start",
    should_stop: Callable[[], bool] = lambda: False,
) -> T:
    """Run ``start`` (anything that starts Ray nodes on this host: ``ray.init(address="local")``, a
    ``ray.cluster_utils.Cluster``) and return its result; when Ray's fixed 30 s wait for a raylet runs
    out (module docstring), kill the Ray processes that attempt started and run ``start`` again, up to
    ``num_attempts`` runs in all, none after ``should_stop()`` is true (a Ctrl-C held meanwhile). After the
    last, its processes are killed too and ``RayStartError`` raised. A start that a KeyboardInterrupt or a
    SystemExit (``ray.init`` installs a SIGTERM handler that exits) cuts short has its processes killed
    and the exception goes on.

    Args:
        start: the starting call; called up to ``num_attempts`` times.
        num_attempts: runs to try (>= 1).
        what: names the start in the warning logged before each retry and in the error.
        should_stop: asked after a timed-out attempt; true: no further attempt (the error is raised).

    Raises:
        ValueError: ``num_attempts`` < 1.
        RayStartError: every attempt timed out (or one did and ``should_stop()`` was true); Ray's own
            error is its cause. Where ``/proc`` is absent, Ray's error itself, at the first timeout.
        Exception: any other error of ``start``, at once.
    """
    import ray

    if num_attempts < 1:
        raise ValueError(f"retry_ray_start: num_attempts must be >= 1, got {num_attempts}")
    ray_dir = os.path.dirname(ray.__file__)
    for attempt in range(1, num_attempts + 1):
        before = descendants()
        t0 = time.monotonic()
        try:
            return start()
        except (KeyboardInterrupt, SystemExit):  # a signal abandoned the start (ray.init's SIGTERM handler
            kill_new_ray_processes(before, ray_dir)  # exits): what it had started goes with it
            raise
        except Exception as e:  # Ray raises a bare Exception for this one
            if STARTUP_TIMEOUT not in str(e) or not HAS_PROC:
                raise
            killed = kill_new_ray_processes(before, ray_dir)
            if attempt == num_attempts or should_stop():
                raise RayStartError(
                    f"{what} failed: a raylet did not register within Ray's 30 s in {attempt} start(s) "
                    f"(host overloaded?); the {len(killed)} processes the last one started were killed"
                ) from e
            log.warning(
                "%s timed out after %.0f s (attempt %d of %d; its raylet did not register: host "
                "overloaded?): killed the %d processes it started, starting again",
                what,
                time.monotonic() - t0,
                attempt,
                num_attempts,
                len(killed),
            )
    raise AssertionError("unreachable")


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The logger of Ray's token-authentication set-up (Ray >= 2.5x), whose banner ``RAY_AUTH_BANNER`` starts."""
RAY_AUTH_BANNER = "Token authentication is enabled for this Ray cluster"
"""How the banner starts that Ray logs at every new local instance when ``RAY_AUTH_MODE`` is unset: token
authentication is on by default, "set RAY_AUTH_MODE=disabled to opt out", a link (three lines on an
80-column console, every run)."""


def _is_not_auth_banner(record: logging.LogRecord) -> bool:
    """A ``logging`` filter: False for Ray's token-auth banner only (its security warnings pass)."""
    return not str(record.msg).startswith(RAY_AUTH_BANNER)


def quiet_ray_auth_banner() -> None:
    """Drop Ray's token-authentication banner (``RAY_AUTH_BANNER``) from this process's log, keeping the
    mode it announces (token authentication, Ray's default for a local instance) and every other message
    of that logger, e.g. the warning that authentication is disabled. Idempotent.

    Why not ``RAY_AUTH_MODE=token``, which also silences it: Ray reads the variable when it is imported, so
    setting it in a process that imported Ray already leaves the driver in the disabled mode while the
    instance it starts requires a token, and ``ray.init`` fails (seen with Ray 2.60)."""
    banner_logger = logging.getLogger(RAY_AUTH_LOGGER)
    if _is_not_auth_banner not in banner_logger.filters:
        banner_logger.addFilter(_is_not_auth_banner)


def start_local_ray(
    num_attempts: int = 3, should_stop: Callable[[], bool] = lambda: False, **init_kwargs
) -> None:
    """``ray.init(address="local", **init_kwargs)``: a new local Ray instance, never another process's
    running cluster, started again when Ray's fixed 30 s wait for its raylet runs out (``retry_ray_start``).
    Ray's token-authentication banner is left out of the console (``quiet_ray_auth_banner``).

    Args:
        num_attempts: starts to try (>= 1).
        should_stop: as in ``retry_ray_start``.
        init_kwargs: the rest of ``ray.init``'s arguments (``num_cpus``, ``include_dashboard``, ...);
            ``address`` is not accepted (this starts a local instance).

    Raises:
        ValueError: ``num_attempts`` < 1 or ``address`` given.
        RayStartError: as ``retry_ray_start``.
    """
    import ray

    if "address" in init_kwargs:
        raise ValueError(
            "start_local_ray starts a local instance: pass no address (use ray.init for a cluster)"
        )
    quiet_ray_auth_banner()
    retry_ray_start(lambda: ray.init(address="local", **init_kwargs), num_attempts, should_stop=should_stop)


def ray_connected() -> bool:
    """Whether this process is connected to a Ray instance (False when Ray was never imported)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def stops_ray_it_started() -> Iterator[None]:
    """Shut down, on the way out, a Ray connection that the body made (a local instance it started, a
    cluster it joined); one that was up before the body is left as found. A run (``moerl.train.train``,
    ``resume``) owns the Ray instance it starts: a second run in the same process starts its own, with
    that run's environment (``PYTHONPATH``, reward modules), instead of inheriting the first one's."""
    before = ray_connected()
    try:
        yield
    finally:
        if not before and ray_connected():
            sys.modules["ray"].shutdown()
