"""Environment workers: where ``reset``/``step`` run, apart from the decode loop.

A pool spreads episodes over ``num_workers`` environment workers; an episode stays on the worker
that reset it (its state lives there). Calls are asynchronous: ``submit`` never blocks, ``poll``
returns the answers that arrived. Two implementations share the bookkeeping (``_PoolBase``):
``LocalEnvPool`` (threads of this process; sync mode and evaluation) and
``moerl.envs.pool_ray.RayEnvPool`` (Ray actors; async mode).

Faults end episodes, never the caller: an environment that raises answers ``error="raised"`` for that
episode; a call that runs past ``step_timeout_s`` (``error="timeout"``) or a worker process that dies
(``error="died"``) loses the worker, so every episode hosted on it ends with that error (the others
get ``error="lost"``), and a fresh worker takes its place.

Backpressure: at most ``max_pending_per_worker`` calls are outstanding on one worker, and it serves
them at once (that many threads, or a threaded actor: environments that wait on I/O or on a remote
tool overlap); further calls wait in the pool's backlog (host memory bounded by the episodes in flight, which the rollout worker
bounds by its slots), in arrival order.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moerl.envs.base import Environment, checked_result
from moerl.envs.stats import EnvStats

RESET, STEP, CLOSE = "reset", "step", "close"


@dataclass(frozen=True, slots=True)
class EnvCall:
    """One call to an episode's environment: ``kind`` reset (payload: a ``Prompt``), step (payload:
    the action text) or close (no answer expected)."""

    episode: str
    kind: str
    payload: object = None


@dataclass(frozen=True, slots=True)
class EnvReply:
    """The answer to an ``EnvCall``: ``value`` (reset: the observation; step: a ``StepResult``), or
    ``error`` (``raised``, ``timeout``, ``died``, ``lost``) with ``message``."""

    episode: str
    kind: str
    value: object = None
    error: str | None = None
    message: str = ""
    latency_s: float = 0.0


class EnvHost:
    """The environments of the episodes one worker hosts, keyed by episode id (in a thread or an actor)."""

    def __init__(self, factory: Callable[[], Environment]) -> None:
        self.factory = factory
        self.envs: dict[str, Environment] = {}
        self.lock = threading.Lock()

    def call(self, episode: str, kind: str, payload) -> tuple[str | None, object]:
        """Run one call; returns ``(None, value)`` or ``("raised", message)`` (never raises).

        Calls of different episodes may run at once (threads of one worker): an episode has at most
        one call outstanding, and the dict of environments is guarded by ``lock``.
        """
        try:
            if kind == RESET:
                env = self.factory()
                with self.lock:
                    self.envs[episode] = env
                obs = env.reset(payload)
                if not isinstance(obs, str):
                    raise TypeError(f"reset() returned {type(obs).__name__}, not str")
                return None, obs
            with self.lock:
                env = self.envs[episode] if kind != CLOSE else self.envs.pop(episode, None)
            if kind == CLOSE:
                if env is not None:
                    env.close()
                return None, None
            result = checked_result(env.step(payload))
            if result.done:
                self._drop(episode)
            return None, result
        except Exception as e:  # noqa: BLE001 - an environment bug ends one episode, not the worker
            self._drop(episode)
            return "raised", f"{type(e).__name__}: {e}"

    def _drop(self, episode: str) -> None:
        with self.lock:
            env = self.envs.pop(episode, None)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - the episode is over either way
                pass


@dataclass
class _Worker:
    """Pool-side record of one environment worker."""

    index: int
    handle: object
    episodes: set[str] = field(default_factory=set)
    outstanding: deque = field(default_factory=deque)  # (call, dispatched_at, token) in dispatch order
    pid: int | None = None


class _PoolBase:
    """Assignment, backlog, timeouts and replacement; subclasses move calls to their workers."""

    def __init__(self, num_workers: int, *, step_timeout_s: float, max_pending_per_worker: int) -> None:
        self.step_timeout_s = step_timeout_s
        self.max_pending = max_pending_per_worker
        self.stats = EnvStats()
        self._workers = [self._spawn(i) for i in range(num_workers)]
        self._home: dict[str, _Worker] = {}  # episode -> its worker
        self._backlog: deque[EnvCall] = deque()
        self._replies: list[EnvReply] = []

    # -- subclass interface
    def _spawn(self, index: int) -> _Worker:
        raise NotImplementedError

    def _dispatch(self, worker: _Worker, call: EnvCall):
        """Start ``call`` on ``worker``; returns a token that ``_collect`` reports it under."""
        raise NotImplementedError

    def _collect(self, timeout_s: float) -> list[tuple[_Worker, object, str | None, object]]:
        """Finished calls as ``(worker, token, error, value)``; ``error`` None, ``raised`` or ``died``."""
        raise NotImplementedError

    def _kill(self, worker: _Worker) -> None:
        raise NotImplementedError

    # -- public API
    @property
    def num_workers(self) -> int:
        """Environment workers (live ones; a lost worker is replaced at once)."""
        return len(self._workers)

    @property
    def num_backlog(self) -> int:
        """Calls waiting for room on their worker (backpressure)."""
        return len(self._backlog)

    def worker_pids(self) -> list[int | None]:
        """Process id of each worker (this process for threads)."""
        return [w.pid for w in self._workers]

    def submit(self, call: EnvCall) -> None:
        """Queue a call; never blocks. A reset picks the least loaded worker for the episode."""
        if call.kind == RESET:
            home = min(self._workers, key=lambda w: (len(w.episodes), w.index))
            home.episodes.add(call.episode)
            self._home[call.episode] = home
        elif call.episode not in self._home:
            return  # the episode already ended (its worker was lost): nothing to close or step
        self._backlog.append(call)
        self._pump()

    def poll(self, timeout_s: float = 0.0) -> list[EnvReply]:
        """Answers that arrived (waiting up to ``timeout_s`` for the first one), then timeouts."""
        now = time.monotonic()
        for worker, token, error, value in self._collect(0.0 if self._replies else timeout_s):
            self._finish(worker, token, error, value, now)
        now = time.monotonic()
        for worker in list(self._workers):  # a worker serves its outstanding calls at once: age = run time
            late = {call.episode for call, at, _ in worker.outstanding if now - at > self.step_timeout_s}
            if late:
                self._lose(worker, "timeout", f"call ran past step_timeout_s={self.step_timeout_s}", late)
        self._pump()
        self.stats.backlog_max = max(self.stats.backlog_max, len(self._backlog))
        out, self._replies = self._replies, []
        return out

    def close(self) -> None:
        """Stop every worker."""
        for w in self._workers:
            self._kill(w)
        self._workers = []

    # -- internals
    def _pump(self) -> None:
        """Dispatch backlog calls whose worker has room, in order."""
        waiting: deque[EnvCall] = deque()
        while self._backlog:
            call = self._backlog.popleft()
            worker = self._home.get(call.episode)
            if worker is None:
                continue
            if len(worker.outstanding) >= self.max_pending:
                waiting.append(call)
                continue
            worker.outstanding.append((call, time.monotonic(), self._dispatch(worker, call)))
        self._backlog = waiting

    def _finish(self, worker: _Worker, token, error: str | None, value, now: float) -> None:
        if worker not in self._workers:
            return  # a late answer from a worker already replaced
        if error == "died":
            self._lose(worker, "died", str(value), {call.episode for call, _, _ in worker.outstanding})
            return
        match = next((i for i, (_, _, tok) in enumerate(worker.outstanding) if tok == token), None)
        if match is None:
            return
        call, at, _ = worker.outstanding[match]
        del worker.outstanding[match]
        latency = now - at
        if call.kind == CLOSE:
            self._forget(call.episode)
            return
        self.stats.record_call(latency, error)
        done = error is not None or (call.kind == STEP and value.done)
        if done:
            self._forget(call.episode)
        self._replies.append(
            EnvReply(
                call.episode, call.kind, None if error else value, error, value if error else "", latency
            )
        )

    def _lose(self, worker: _Worker, error: str, message: str, culprits: set[str]) -> None:
        """Kill and replace ``worker``; every episode it hosted ends (``error`` for ``culprits``, the
        episodes whose calls timed out or were running when it died; ``lost`` for the others)."""
        self.stats.record_loss(error)
        self._kill(worker)
        for episode in sorted(worker.episodes):
            kind = error if episode in culprits else "lost"
            self._replies.append(EnvReply(episode, STEP, None, kind, message))
            self.stats.record_error(kind)
            self._home.pop(episode, None)
        self._workers[self._workers.index(worker)] = self._spawn(worker.index)

    def _forget(self, episode: str) -> None:
        worker = self._home.pop(episode, None)
        if worker is not None:
            worker.episodes.discard(episode)


class LocalEnvPool(_PoolBase):
    """Environment workers as threads of this process (sync mode, evaluation, tests).

    A thread whose call hangs cannot be stopped: on a timeout it is abandoned (its late answer is
    ignored) and a new thread with a fresh ``EnvHost`` replaces it.
    """

    def __init__(
        self,
        factory: Callable[[], Environment],
        num_workers: int,
        *,
        step_timeout_s: float = 30.0,
        max_pending_per_worker: int = 4,
    ) -> None:
        self.factory = factory
        self._answers: queue.Queue = queue.Queue()
        self._next_token = 0
        super().__init__(
            num_workers, step_timeout_s=step_timeout_s, max_pending_per_worker=max_pending_per_worker
        )

    def _spawn(self, index: int) -> _Worker:
        inbox: queue.Queue = queue.Queue()
        host = EnvHost(self.factory)
        worker = _Worker(index, handle=inbox)

        def serve() -> None:
            while (item := inbox.get()) is not None:
                token, call = item
                self._answers.put((worker, token, *host.call(call.episode, call.kind, call.payload)))

        for t in range(self.max_pending):  # one thread per call the worker may have outstanding
            threading.Thread(target=serve, name=f"env-worker-{index}.{t}", daemon=True).start()
        worker.pid = os.getpid()
        return worker

    def _dispatch(self, worker: _Worker, call: EnvCall):
        self._next_token += 1
        worker.handle.put((self._next_token, call))
        return self._next_token

    def _collect(self, timeout_s: float):
        out = []
        try:
            out.append(self._answers.get(timeout=timeout_s) if timeout_s > 0 else self._answers.get_nowait())
            while True:
                out.append(self._answers.get_nowait())
        except queue.Empty:
            pass
        return out

    def _kill(self, worker: _Worker) -> None:
        for _ in range(self.max_pending):
            worker.handle.put(None)  # a hung thread never reads it: abandoned (daemon)
