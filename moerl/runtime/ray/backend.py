"""The ``WorkerBackend`` of async mode: rollout workers as Ray actors.

Each worker actor must offer ``run()`` (its generation loop; returns a ``WorkerExit`` or anything else
for a plain stop), ``health()`` (a ``WorkerHealth``; served on a second actor thread while ``run``
loops), ``stop()`` and ``notify()`` (a termination notice by actor call). Liveness is one outstanding ``health`` call per worker: each answer counts as a
heartbeat and the next call is sent at the next poll. A worker whose ``run`` call fails with an actor
error died (SIGKILL, node lost, out of memory); Ray reports that within about a second on one machine.
A ``run`` that raised a Python exception is a bug, not an interruption: ``poll`` re-raises it.
A node that vanishes without Ray noticing is caught by the manager's heartbeat timeout instead.

Termination notices reach a worker as a file (``notice_path(worker_id)``) holding a spot
``instance-action`` document, which the worker's ``NoticeWatcher`` polls, or by its ``notify()`` when no
file is configured; chaos SIGKILLs the worker's
process by the pid that its health answers carry (same machine only; on a cluster it falls back to
``ray.kill``, which also ends the process without a drain).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from moerl.runtime.chaos import sigkill, write_notice
from moerl.runtime.fleet import WorkerExit, WorkerHealth


class RayWorkerBackend:
    """Spawns and watches rollout worker actors (module docstring).

    Args:
        make_actor: ``worker_id -> actor handle`` (creates the actor; must not wait for it).
        notice_path: ``worker_id ->`` the notice file that worker watches, or None (notice by actor call).
        notice_seconds: the termination time written into a notice, seconds from now.
    """

    def __init__(
        self,
        make_actor: Callable[[str], object],
        *,
        notice_path: Callable[[str], Path | None] = lambda worker_id: None,
        notice_seconds: float = 120.0,
    ):
        self.make_actor = make_actor
        self.notice_path = notice_path
        self.notice_seconds = notice_seconds
        self.handles: dict[str, object] = {}
        self._runs: dict[object, str] = {}  # run() ref -> worker id
        self._pings: dict[str, object] = {}  # worker id -> outstanding health() ref
        self._where: dict[str, tuple[str, int]] = {}  # worker id -> (hostname, pid)

    def spawn(self, worker_id: str) -> None:
        handle = self.make_actor(worker_id)
        self.handles[worker_id] = handle
        self._runs[handle.run.remote()] = worker_id
        self._pings[worker_id] = handle.health.remote()

    def poll(self) -> tuple[dict[str, WorkerHealth], list[WorkerExit]]:
        import ray

        exits = []
        if self._runs:
            done, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0)
            for ref in done:
                exits.append(self._exit_of(self._runs.pop(ref), ref))
        gone = {e.worker_id for e in exits}
        health = {}
        pending = {ref: wid for wid, ref in self._pings.items() if wid not in gone}
        if pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in done:
                wid = pending[ref]
                try:
                    h = ray.get(ref)
                except ray.exceptions.RayError:
                    self._pings.pop(wid, None)  # died: its run() ref reports how
                    continue
                health[wid] = h
                if h.pid:
                    self._where[wid] = (h.hostname, h.pid)
                self._pings[wid] = self.handles[wid].health.remote()
        for wid in gone:
            self._pings.pop(wid, None)
            self.handles.pop(wid, None)
        return health, exits

    def _exit_of(self, worker_id: str, ref) -> WorkerExit:
        import ray

        try:
            result = ray.get(ref)  # a Python exception of the worker's loop propagates (a bug)
        except ray.exceptions.RayActorError as e:  # the process died: SIGKILL, node lost, OOM
            return WorkerExit(
                worker_id, "crashed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            )
        return result if isinstance(result, WorkerExit) else WorkerExit(worker_id, "stopped")

    def kill(self, worker_id: str) -> None:
        import ray

        handle = self.handles.pop(worker_id, None)
        self._pings.pop(worker_id, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)

    def kill_hard(self, worker_id: str) -> None:
        """SIGKILL the worker's process (``ray.kill`` when its pid is unknown or on another machine)."""
        import ray

        host, pid = self._where.get(worker_id, ("", 0))
        handle = self.handles.get(worker_id)
        if pid and host == socket.gethostname():
            sigkill(pid)
        elif handle is not None:
            ray.kill(handle, no_restart=True)

    def notify(self, worker_id: str) -> None:
        path = self.notice_path(worker_id)
        if path is not None:
            write_notice(path, seconds_from_now=self.notice_seconds)
        elif worker_id in self.handles:
            self.handles[worker_id].notify.remote()

    def alive_handles(self) -> list[object]:
        """Handles of the workers not known to have exited."""
        return list(self.handles.values())

    def stop_all(self, timeout_s: float = 30.0) -> list[WorkerExit]:
        """Ask every worker to stop and wait for their runs; returns their exits."""
        import ray

        for handle in self.handles.values():
            handle.stop.remote()
        refs = list(self._runs)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        return [self._exit_of(self._runs.pop(ref), ref) for ref in done]
