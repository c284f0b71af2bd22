"""The engine of an EP rollout worker group: a leader rank drives ``ep_size - 1`` followers in lockstep.

    leader, EP rank 0 (the RolloutWorker's engine)         follower, EP rank r = 1 .. R-1
    EPGroupEngine.step():                                  EPFollower.run(), per step:
        exchange(command)   <----- all-gather ------>          command = exchange(report)
          command: new requests per rank, weights                apply: cancel, weights version,
          version to switch to, recompute, cancel, stop          recompute, new requests, stop
        EPEngine.step()     <== lockstep forwards ==>          EPEngine.step()
        own completions + the followers' reports               report: completions, new tokens of
          (one step late)                                        running samples, unfinished count

The worker sees one engine (the ``Engine`` seam: ``add_request``, ``step``, ``update_weights``,
``version``, ``num_slots``, ``running_by_request``) with the slots of all ranks. ``add_request`` puts a
request (one group of n samples) on the least-loaded rank; attention and KV cache are data-parallel,
so each rank runs its own slots, and ``EPEngine`` keeps the ranks' forwards in lockstep for the expert
exchange (a rank without work joins with zero tokens). A weight switch happens on every rank at the
same step: the leader switches in ``update_weights`` (between steps) and the next command carries the
version, which each follower loads from its own source (``load_version``: its bucket assembler or
the store; ``EPEngine.update_weights`` keeps only the rank's local experts) before that step's forwards.

The command exchange is one ``all_gather`` of pickled objects per step on a gloo group (``ctrl``), each
rank waiting with its own timeout (``Work.wait``): the leader ``timeout_s`` (a follower that does not
answer), a follower ``idle_timeout_s`` (the leader has nothing to do; while idle it sends an empty step
every ``keepalive_s``, ``keepalive``). A killed rank closes its sockets and the others' pending
collective fails at once; a follower that fails ends its process, which the leader sees the same way.
Every failure on the leader is raised as ``EPGroupError``, which ends the worker (its leases go back
to the queue, the fleet replaces the group).

Payloads are pickled: the ranks are processes of one run, trusted like Ray's own pickled calls.
"""

from __future__ import annotations

import datetime
import io
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moerl.ep.traffic import DirectionTraffic, sum_traffic
from moerl.rollout.ep_engine import EPEngine
from moerl.rollout.params import Completion, InvalidRequestError, Request, validate_request
from moerl.rollout.weight_update import cancel_all


class EPGroupError(RuntimeError):
    """A rank of the EP rollout group died, hung past its timeout or failed: the group is lost."""


@dataclass(frozen=True, slots=True)
class GroupCommand:
    """What the leader tells the followers at the start of one step."""

    requests: tuple[tuple[Request, ...], ...] = ()
    """New requests of each follower (index r - 1 for EP rank r)."""
    version: int | None = None
    """Policy version to switch to before this step's forwards (None: keep the current one)."""
    cancel: bool = False
    """Drop every waiting and running request first (``rollout.on_weight_update=abort``)."""
    recompute: bool = False
    """After the switch, re-prefill the running prefixes under the new weights, in lockstep
    (``rollout.on_weight_update=recompute``, ``EPEngine.recompute_running``)."""
    stop: bool = False
    """Leave the loop (the group is closing); no forward follows."""


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a follower tells the leader about its previous step."""

    completions: tuple[Completion, ...] = ()
    """Samples that finished."""
    progress: tuple[tuple[str, int, tuple[int, ...], tuple[float, ...], tuple[int, ...]], ...] = ()
    """``(request_id, sample_index, new token ids, their log-probs, their policy versions)`` of each
    running sample that has host-synced tokens it did not report before."""
    num_unfinished: int = 0
    """Samples waiting or running on the rank."""
    ep_traffic: DirectionTraffic | None = None
    """Bytes the rank's dispatcher sent since it started, by direction (``EPEngine.ep_traffic``, cumulative)."""


_SAFE_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool"}
)


class _GroupUnpickler(pickle.Unpickler):
    """Unpickles only what the group's commands and reports are made of: moerl's own classes and plain
    builtins (Python's restricted-unpickler recipe); anything else is a ``pickle.UnpicklingError``."""

    def find_class(self, module: str, name: str):
        if module.startswith("moerl.") or (module == "builtins" and name in _SAFE_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"EP group message refers to {module}.{name}, which it may not carry")


def exchange_objects(obj, group: dist.ProcessGroup, timeout_s: float) -> list:
    """All-gather one picklable object per rank of ``group`` (gloo, CPU tensors); waits ``timeout_s``.

    Two collectives: the sizes, then the payloads padded to the largest.

    Raises:
        RuntimeError: a rank died (its sockets closed) or did not join within ``timeout_s``.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = dist.get_world_size(group)
    wait = datetime.timedelta(seconds=timeout_s)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group, async_op=True).wait(wait)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(out, padded, group=group, async_op=True).wait(wait)
    return [
        _GroupUnpickler(io.BytesIO(o[: int(n.item())].numpy().tobytes())).load()
        for o, n in zip(out, sizes, strict=True)
    ]


@dataclass(slots=True)
class RemoteSequence:
    """The leader's copy of a follower's running sample (``moerl.runtime.drain.group_progress`` reads it)."""

    request: Request
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)


class EPGroupEngine:
    """The leader's engine over the whole EP group (module docstring); the ``Engine`` seam.

    Args:
        ep: the leader's ``EPEngine`` (EP rank 0 of the group).
        ctrl: a gloo group over the same ranks for the command exchange.
        timeout_s: seconds the leader waits for the followers at a step (a follower that does not
            answer in time is a lost group).
        keepalive_s: while idle, an empty step at most this often, so that followers waiting for
            commands do not reach their own timeout.

    Not thread-safe except ``running_by_request`` and the read-only properties (a health thread).
    """

    def __init__(
        self, ep: EPEngine, ctrl: dist.ProcessGroup, *, timeout_s: float = 30.0, keepalive_s: float = 1.0
    ) -> None:
        if ep.rank != 0:
            raise ValueError(f"EPGroupEngine runs on EP rank 0, not {ep.rank}")
        self.ep = ep
        self.ctrl = ctrl
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.ep_size = ep.ep_size
        e = ep.engine
        self._limits = {
            "vocab_size": e.vocab_size,
            "max_seq_len": e.max_seq_len,
            "max_stop_tokens": e.max_stop_tokens,
        }
        self._outgoing: list[list[Request]] = [[] for _ in range(self.ep_size - 1)]
        self._version_to_send: int | None = None
        self._cancel = False
        self._recompute = False
        self._load = [0] * self.ep_size  # samples assigned to each rank and not finished
        self._owner: dict[str, list[int]] = {}  # request id -> [rank, samples not finished]
        self._remote: dict[tuple[str, int], RemoteSequence] = {}
        self._requests: dict[str, Request] = {}  # follower requests in flight, by id
        self._lock = threading.Lock()  # guards _remote against running_by_request on another thread
        self._held: list[Completion] = []  # finished during a keepalive step
        self._last_exchange = time.monotonic()
        self._closed = False
        self._rank_traffic: list[DirectionTraffic | None] = [None] * (self.ep_size - 1)  # followers' last
        self.num_steps = 0

    @property
    def version(self) -> int:
        """Policy version of the group's weights (the leader's; followers switch at the next step)."""
        return self.ep.version

    @property
    def num_slots(self) -> int:
        """Sequence slots of the whole group (every rank has the leader's)."""
        return self.ep.engine.num_slots * self.ep_size

    @property
    def ep_traffic(self) -> DirectionTraffic | None:
        """EP bytes the group's ranks sent since it started, summed over the ranks, by direction and link
        class (``moerl.ep.traffic``; cumulative): the leader's now, each follower's as of its last report
        (one step late; complete after ``close``). Safe from another thread (a health thread)."""
        return sum_traffic([self.ep.ep_traffic, *self._rank_traffic])

    @property
    def num_unfinished(self) -> int:
        """Samples waiting or running on any rank (a follower's count as of its last report)."""
        return sum(self._load)

    def add_request(self, request: Request) -> None:
        """Validate ``request`` and queue it on the least-loaded rank (a follower's at the next step).

        Raises:
            InvalidRequestError: as ``Engine.add_request`` (nothing is queued).
        """
        if request.request_id in self._owner:
            raise InvalidRequestError(request.request_id, "a request with this id is already in flight")
        rank = min(range(self.ep_size), key=lambda r: (self._load[r], r))
        if rank == 0:
            self.ep.add_request(request)
        else:
            validate_request(request, **self._limits)
            self._outgoing[rank - 1].append(request)
            self._requests[request.request_id] = request
        self._owner[request.request_id] = [rank, request.params.n]
        self._load[rank] += request.params.n

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Switch the leader now (its local experts only) and every follower before the next step's
        forwards: the next command carries ``version``, which each follower loads itself."""
        self.ep.update_weights(named_tensors, version)
        self._version_to_send = int(version)

    def recompute_running(self) -> list[Completion]:
        """Re-prefill every rank's running prefixes under the new weights (after ``update_weights``):
        done in lockstep at the start of the next step, before its forwards; the completions its host
        sync finishes come out of that step. Returns [] (``weight_update.recompute_running``'s seam)."""
        self._recompute = True
        return []

    def cancel_all(self) -> None:
        """Drop every request on every rank (followers at the next step); their completions are lost."""
        cancel_all(self.ep.engine)
        self._cancel = True
        self._outgoing = [[] for _ in range(self.ep_size - 1)]
        self._load = [0] * self.ep_size
        self._owner.clear()
        self._requests.clear()
        self._held.clear()
        with self._lock:
            self._remote.clear()

    def running_by_request(self) -> dict[str, list]:
        """Running samples by request id: the leader's engine ``Sequence``s and ``RemoteSequence`` copies
        of the followers' (their tokens as of the last report). Safe from another thread."""
        out: dict[str, list] = {rid: list(seqs) for rid, seqs in self.ep.running_by_request().items()}
        with self._lock:
            remote = list(self._remote.values())
        for seq in remote:
            out.setdefault(seq.request.request_id, []).append(seq)
        return out

    def step(self) -> list[Completion]:
        """One lockstep step of the group (collective); the completions of every rank that arrived.

        Raises:
            EPGroupError: a rank died, failed, or did not answer within ``timeout_s``.
        """
        if self._closed:
            raise EPGroupError("the EP group is closed")
        command = GroupCommand(
            requests=tuple(tuple(r) for r in self._outgoing),
            version=self._version_to_send,
            cancel=self._cancel,
            recompute=self._recompute,
        )
        try:
            reports = exchange_objects(command, self.ctrl, self.timeout_s)
            self._last_exchange = time.monotonic()
            self._outgoing = [[] for _ in range(self.ep_size - 1)]
            self._version_to_send, self._cancel, self._recompute = None, False, False
            done = self.ep.recompute_running() if command.recompute else []  # collective
            done += self.ep.step()  # collective: the EP exchange of every MoE layer
        except Exception as e:  # a dead peer (connection closed) or a timeout: the group is lost
            self._closed = True
            raise EPGroupError(
                f"EP rollout group of {self.ep_size} ranks lost a rank: {_first_line(e)}"
            ) from e
        self.num_steps += 1
        for c in done:
            self._finished(c)
        self._note_traffic(reports)
        for rank, report in enumerate(reports[1:], start=1):
            done += self._apply_report(rank, report)
        held, self._held = self._held, []
        return held + done

    def _note_traffic(self, reports: list) -> None:
        self._rank_traffic = [
            r.ep_traffic if r.ep_traffic is not None else old
            for r, old in zip(reports[1:], self._rank_traffic, strict=True)
        ]

    def _apply_report(self, rank: int, report: RankReport) -> list[Completion]:
        with self._lock:
            for rid, j, ids, lps, vers in report.progress:
                seq = self._remote.get((rid, j))
                if seq is None:
                    if rid not in self._requests:
                        continue  # cancelled meanwhile
                    seq = self._remote[(rid, j)] = RemoteSequence(self._requests[rid], j)
                seq.token_ids += ids
                seq.logprobs += lps
                seq.policy_versions += vers
        done = [c for c in report.completions if c.request_id in self._owner]  # else: cancelled meanwhile
        for c in done:
            with self._lock:
                self._remote.pop((c.request_id, c.sample_index), None)
            self._finished(c)
        return done

    def _finished(self, c: Completion) -> None:
        owner = self._owner.get(c.request_id)
        if owner is None:
            return
        self._load[owner[0]] -= 1
        owner[1] -= 1
        if owner[1] == 0:
            del self._owner[c.request_id]
            self._requests.pop(c.request_id, None)

    def keepalive(self) -> None:
        """An empty step if none ran for ``keepalive_s`` (call while idle); its completions are
        returned by the next ``step``.

        Raises:
            EPGroupError: as ``step``.
        """
        if not self._closed and time.monotonic() - self._last_exchange >= self.keepalive_s:
            self._held = self.step()

    def close(self, timeout_s: float = 5.0) -> None:
        """Tell the followers to leave their loops (best effort: a lost group is not waited for)."""
        if self._closed:
            return
        self._closed = True
        try:
            reports = exchange_objects(GroupCommand(stop=True), self.ctrl, timeout_s)
        except Exception:  # a follower already gone: nothing to stop
            return
        self._note_traffic(reports)  # the followers' last steps: ep_traffic is now the group's total


class EPFollower:
    """The loop of EP rank r >= 1 of a rollout group (module docstring).

    Args:
        ep: this rank's ``EPEngine``.
        ctrl: the group's gloo group for the command exchange.
        load_version: ``version -> named full-model tensors`` of that policy version (this rank's
            bucket assembler or the store); ``EPEngine.update_weights`` keeps the local experts.
        idle_timeout_s: seconds to wait for the leader's next command (the leader sends an empty step
            at least every ``keepalive_s`` while idle, and a dead leader fails the wait at once).
    """

    def __init__(
        self,
        ep: EPEngine,
        ctrl: dist.ProcessGroup,
        load_version: Callable[[int], Mapping[str, torch.Tensor]],
        *,
        idle_timeout_s: float = 300.0,
    ) -> None:
        self.ep = ep
        self.ctrl = ctrl
        self.load_version = load_version
        self.idle_timeout_s = idle_timeout_s
        self._reported: dict[tuple[str, int], int] = {}  # tokens of each running sample reported
        self.num_steps = 0

    def run(self) -> int:
        """Follow the leader's commands until ``stop``; returns the steps run.

        Raises:
            RuntimeError: the leader died or did not send a command within ``idle_timeout_s``, or this
                rank failed (its process should then exit: its closed sockets fail the leader's step
                at once, where a report would wait for the leader's next exchange).
        """
        report = RankReport()
        while True:
            command = exchange_objects(report, self.ctrl, self.idle_timeout_s)[0]
            if command.stop:
                return self.num_steps
            done = self._apply(command) + self.ep.step()
            self.num_steps += 1
            report = self._report(done)

    def _apply(self, command: GroupCommand) -> list[Completion]:
        if command.cancel:
            cancel_all(self.ep.engine)
            self._reported.clear()
        if command.version is not None:
            self.ep.update_weights(self.load_version(command.version), command.version)
        done = self.ep.recompute_running() if command.recompute else []  # collective
        for r in command.requests[self.ep.rank - 1]:
            self.ep.add_request(r)
        return done

    def _report(self, done: list[Completion]) -> RankReport:
        for c in done:
            self._reported.pop((c.request_id, c.sample_index), None)
        progress = []
        for seq in self.ep.engine.scheduler.running:
            key = (seq.request.request_id, seq.sample_index)
            sent = self._reported.get(key, 0)
            n = min(len(seq.token_ids), len(seq.logprobs), len(seq.policy_versions))
            if n > sent:
                progress.append(
                    (
                        *key,
                        tuple(seq.token_ids[sent:n]),
                        tuple(seq.logprobs[sent:n]),
                        tuple(seq.policy_versions[sent:n]),
                    )
                )
                self._reported[key] = n
        return RankReport(tuple(done), tuple(progress), self.ep.num_unfinished, self.ep.ep_traffic)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"
