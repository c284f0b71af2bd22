"""Typed records that cross the runtime's boundaries: task -> lease -> samples -> group -> weights.

Data flows one way: the ``TaskQueue`` hands out ``Lease``s on ``RolloutTask``s; a rollout worker turns a
lease into a ``Group`` of ``Sample``s and puts it in the ``ExperienceBuffer``; the trainer publishes
``WeightVersion``s through the ``WeightStore``. Every record here is a frozen dataclass; lists inside
samples are stored as tuples so that a record cannot change after it crossed a boundary.

Lengths: ``P`` = prompt tokens, ``R`` = response tokens, ``L_moe`` = MoE layers, ``k`` = top-k.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # a Sample holds a tensor only with routing replay; the exchange never imports torch
    import torch


def _as_tuple(obj: Any, name: str, values: Sequence[Any]) -> None:
    """Store ``values`` as a tuple on the frozen dataclass ``obj`` (accepts lists from callers)."""
    object.__setattr__(obj, name, tuple(values))


@dataclass(frozen=True, slots=True)
class PartialResponse:
    """The generated prefix of one response, handed back on a drain so that the next worker continues it.

    All three sequences have the same length (the prefix length).
    """

    sample_index: int
    """Which of the task's n samples this prefix belongs to, in [0, n)."""
    response_ids: tuple[int, ...]
    """Token ids generated so far."""
    response_logprobs: tuple[float, ...]
    """Behaviour log-prob of each generated token."""
    policy_versions: tuple[int, ...]
    """Policy version that generated each token."""

    def __post_init__(self) -> None:
        for name in ("response_ids", "response_logprobs", "policy_versions"):
            _as_tuple(self, name, getattr(self, name))
        if not len(self.response_ids) == len(self.response_logprobs) == len(self.policy_versions):
            raise ValueError(
                f"PartialResponse {self.sample_index}: response_ids, response_logprobs and policy_versions "
                f"have lengths {len(self.response_ids)}, {len(self.response_logprobs)}, {len(self.policy_versions)}"
            )


@dataclass(frozen=True, slots=True)
class LeaseSnapshot:
    """A rollout worker's progress on one leased group, sent to the exchange (``TaskQueue.save_progress``).

    Kept there only while ``lease_token`` is the task's current lease, newest only; when the lease expires
    (the worker lost) the prefixes become the task's ``partial`` and the next worker continues them.
    """

    task_id: str
    """The leased task."""
    lease_token: int
    """Fencing token of the lease the progress was made under."""
    prefixes: tuple[PartialResponse, ...]
    """Generated tokens, one entry per sample that has new ones (finished samples whole): the tokens from
    ``offsets[i]`` on of sample ``prefixes[i].sample_index`` (a delta on what the exchange holds)."""
    offsets: tuple[int, ...] = ()
    """Per prefix, how many of the sample's tokens come before it (the exchange holds them from an earlier
    snapshot of this lease); empty: all 0, whole prefixes."""

    def __post_init__(self) -> None:
        _as_tuple(self, "prefixes", self.prefixes)
        _as_tuple(self, "offsets", self.offsets or (0,) * len(self.prefixes))
        if len(self.offsets) != len(self.prefixes) or any(o < 0 for o in self.offsets):
            raise ValueError(
                f"LeaseSnapshot {self.task_id!r}: {len(self.offsets)} offsets (each >= 0) for "
                f"{len(self.prefixes)} prefixes"
            )

    @property
    def num_tokens(self) -> int:
        """Response tokens held, over the group's samples."""
        return sum(len(p.response_ids) for p in self.prefixes)


def append_prefixes(
    held: Sequence[PartialResponse], pieces: Sequence[PartialResponse], offsets: Sequence[int]
) -> tuple[PartialResponse, ...] | None:
    """``held`` with each piece appended to its sample at its offset (offset 0: the piece replaces the
    sample's prefix if at least as long). None if a piece's offset is not the held prefix's length (a gap
    or an overlap: the snapshot does not continue what is held). Sorted by sample index."""
    best = {p.sample_index: p for p in held}
    for piece, offset in zip(pieces, offsets, strict=True):
        old = best.get(piece.sample_index)
        if offset == 0:
            if old is None or len(piece.response_ids) >= len(old.response_ids):
                best[piece.sample_index] = piece
            continue
        if old is None or len(old.response_ids) != offset:
            return None
        best[piece.sample_index] = PartialResponse(
            piece.sample_index,
            old.response_ids + piece.response_ids,
            old.response_logprobs + piece.response_logprobs,
            old.policy_versions + piece.policy_versions,
        )
    return tuple(best[i] for i in sorted(best))


def merge_prefixes(
    old: Sequence[PartialResponse], new: Sequence[PartialResponse]
) -> tuple[PartialResponse, ...]:
    """Per sample index the longer of ``old`` and ``new`` (a newer snapshot extends an older one; a sample
    missing from ``new``, e.g. queued again in the engine, keeps its ``old`` prefix). Sorted by index."""
    best = {p.sample_index: p for p in old}
    for p in new:
        if p.sample_index not in best or len(p.response_ids) >= len(best[p.sample_index].response_ids):
            best[p.sample_index] = p
    return tuple(best[i] for i in sorted(best))


@dataclass(frozen=True, slots=True)
class RolloutTask:
    """One prompt to be answered ``num_samples`` times: one GRPO group.

    A task keeps its ``task_id`` across retries; only ``attempt`` changes when it is leased again.
    """

    task_id: str
    """Unique, stable id of the task in the run, ``"<data index>:<prompt id>"``; the ledger key."""
    prompt_ids: tuple[int, ...]
    """Templated prompt as token ids, length P."""
    prompt_text: str
    """Templated prompt text (what the reward function sees)."""
    answer: str
    """Task-specific reference answer, passed to the reward function."""
    num_samples: int
    """Group size n: responses to generate for this prompt."""
    attempt: int = 0
    """How many times the task has been leased, this lease included (0: never leased yet)."""
    partial: tuple[PartialResponse, ...] = ()
    """Response prefixes left by an earlier lease that was drained (``TaskQueue.release(lease, partial=...)``);
    a worker may continue them instead of starting over. Empty normally."""
    extra: dict | None = field(default=None, hash=False)
    """The prompt's dataset-row columns the task does not consume (JSON values, nested as they are), passed
    to a reward function that takes ``extra=`` (``moerl.tasks.rewards``); None: none."""

    def __post_init__(self) -> None:
        _as_tuple(self, "prompt_ids", self.prompt_ids)
        _as_tuple(
            self,
            "partial",
            (p if isinstance(p, PartialResponse) else PartialResponse(**p) for p in self.partial),
        )
        if self.num_samples < 1:
            raise ValueError(f"RolloutTask {self.task_id!r}: num_samples={self.num_samples} must be >= 1")
        for p in self.partial:
            if not 0 <= p.sample_index < self.num_samples:
                raise ValueError(
                    f"RolloutTask {self.task_id!r}: partial sample_index={p.sample_index} not in [0, {self.num_samples})"
                )


@dataclass(frozen=True, slots=True)
class Lease:
    """The right of one worker to work on one task until ``expires_at``.

    A lease is valid while its ``token`` is the task's current token in the queue. The token is a fencing
    token: strictly increasing over all leases the queue ever issued (also across a resume), so a delivery
    or ack carrying an older token is recognised and refused.
    """

    task: RolloutTask
    """The task, with ``attempt`` counting this lease."""
    worker_id: str
    """Id of the worker that holds the lease."""
    token: int
    """Fencing token, >= 1, strictly increasing over all leases of the queue."""
    expires_at: float
    """Expiry time in seconds on the queue's clock (``time.monotonic`` of the queue's process unless injected).
    Not comparable with another process's clock: renew by heartbeat every ttl / 3 or so instead."""

    @property
    def task_id(self) -> str:
        """The leased task's id."""
        return self.task.task_id


@dataclass(frozen=True, slots=True)
class Sample:
    """One generated response to a prompt, scored.

    ``response_ids``, ``response_logprobs``, ``loss_mask`` and ``policy_versions`` all have length R.
    """

    prompt_ids: tuple[int, ...]
    """Prompt token ids, length P."""
    response_ids: tuple[int, ...]
    """Generated token ids, length R (including the stop token if one was generated)."""
    response_logprobs: tuple[float, ...]
    """Behaviour-policy log-prob of each generated token (log softmax of logits / temperature), length R."""
    loss_mask: tuple[int, ...]
    """1 for tokens that enter the loss, 0 for tokens that do not (e.g. tool output), length R."""
    finish_reason: str
    """Why generation stopped: ``"stop"`` (stop token), ``"length"`` (max_new_tokens) or ``"abort"``."""
    policy_versions: tuple[int, ...]
    """Policy (weight) version that generated each response token, length R; a version may change mid-response."""
    reward: float
    """Scalar reward of the response."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """Named sub-scores and flags of the reward function (e.g. ``{"format": 1.0, "error": 0.0}``)."""
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    """Routed expert ids ``[P + R - 1, L_moe, k]`` int64 as recorded by the engine (rollout routing replay,
    R3): one row per token fed to the model, i.e. the prompt and every response token but the last, which
    is sampled and never fed (``moerl.rollout.Completion.routed_experts``); None unless requested."""

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "policy_versions"):
            _as_tuple(self, name, getattr(self, name))
        num_response = len(self.response_ids)
        for name in ("response_logprobs", "loss_mask", "policy_versions"):
            if len(getattr(self, name)) != num_response:
                raise ValueError(
                    f"Sample.{name} has length {len(getattr(self, name))}; expected R={num_response} "
                    "(the length of response_ids)"
                )

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version that generated a token of this sample (-1 for an empty response)."""
        return min(self.policy_versions, default=-1)

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens, P + R."""
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True, slots=True)
class Group:
    """All ``n`` samples of one task, delivered by one worker under one lease.

    Build it with ``Group.from_lease`` so that the derived fields are consistent.
    """

    task: RolloutTask
    """The task the group answers (needed to requeue it when the group turns stale in the buffer)."""
    lease_token: int
    """Fencing token of the lease it was generated under; the buffer refuses it if no longer current."""
    worker_id: str
    """Worker that generated it."""
    samples: tuple[Sample, ...]
    """The n samples (n = ``task.num_samples``)."""
    min_policy_version: int
    """Oldest policy version over all tokens of all samples; the staleness rule uses it."""
    gen_seconds: float
    """Wall time the worker spent generating the group, in seconds."""
    num_tokens: int
    """Prompt plus response tokens over all samples."""

    def __post_init__(self) -> None:
        _as_tuple(self, "samples", self.samples)
        if not self.samples:
            raise ValueError(f"Group for task {self.task.task_id!r} has no samples")

    @property
    def task_id(self) -> str:
        """Id of the task the group answers."""
        return self.task.task_id

    @property
    def rewards(self) -> tuple[float, ...]:
        """Reward of each sample, in order."""
        return tuple(s.reward for s in self.samples)

    @classmethod
    def from_lease(cls, lease: Lease, samples: Sequence[Sample], gen_seconds: float) -> Group:
        """Group the samples generated under ``lease``; derives ``min_policy_version`` and ``num_tokens``."""
        return cls(
            task=lease.task,
            lease_token=lease.token,
            worker_id=lease.worker_id,
            samples=tuple(samples),
            min_policy_version=min(s.min_policy_version for s in samples) if samples else -1,
            gen_seconds=float(gen_seconds),
            num_tokens=sum(s.num_tokens for s in samples),
        )


class Settlement(enum.StrEnum):
    """How the buffer disposed of a delivered group; the queue's ``settle`` records it for the task."""

    ADMITTED = "admitted"
    """Stored for training: the task is done."""
    FILTERED = "filtered"
    """Rejected by a group filter (e.g. DAPO dynamic sampling): the task is done, not trained."""
    DROPPED_STALE = "dropped_stale"
    """Too stale, dropped (``stale_policy="drop"``): the task is done, not trained."""
    REQUEUED_STALE = "requeued_stale"
    """Too stale, task handed back to the queue (``stale_policy="requeue"``)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a published weight version."""

    name: str
    """Parameter name, as in the model's ``state_dict``."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: str
    """Torch dtype name without the ``torch.`` prefix, e.g. ``"float32"``."""
    file: str
    """File (relative to the version folder) that holds it."""

    def __post_init__(self) -> None:
        _as_tuple(self, "shape", self.shape)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One data file of a published weight version."""

    path: str
    """File name relative to the version folder, e.g. ``"model.safetensors"``."""
    sha256: str
    """Hex SHA-256 of the file's bytes."""
    num_bytes: int
    """File size in bytes."""


@dataclass(frozen=True, slots=True)
class WeightManifest:
    """The commit record of a weight version: written last; a version without one does not exist."""

    version: int
    """Policy version number."""
    created_at: float
    """Publication time, seconds since the Unix epoch."""
    files: tuple[FileEntry, ...]
    """Data files with their checksums."""
    tensors: tuple[TensorEntry, ...]
    """Every tensor of the snapshot."""

    def __post_init__(self) -> None:
        _as_tuple(self, "files", self.files)
        _as_tuple(self, "tensors", self.tensors)

    def to_json_dict(self) -> dict[str, Any]:
        """Plain dict for ``manifest.json``."""
        return {
            "format": "moerl-weights/1",
            "version": self.version,
            "created_at": self.created_at,
            "files": [{"path": f.path, "sha256": f.sha256, "num_bytes": f.num_bytes} for f in self.files],
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "file": t.file}
                for t in self.tensors
            ],
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> WeightManifest:
        """Inverse of ``to_json_dict``. Raises ``ValueError`` on an unknown format or missing key."""
        if data.get("format") != "moerl-weights/1":
            raise ValueError(f"unknown weight manifest format {data.get('format')!r}")
        try:
            return cls(
                version=int(data["version"]),
                created_at=float(data["created_at"]),
                files=tuple(FileEntry(f["path"], f["sha256"], int(f["num_bytes"])) for f in data["files"]),
                tensors=tuple(
                    TensorEntry(t["name"], tuple(t["shape"]), t["dtype"], t["file"]) for t in data["tensors"]
                ),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed weight manifest: {e!r}") from e


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """A complete, published weight snapshot in a ``WeightStore``."""

    version: int
    """Policy version number: +1 per publish (gaps allowed), strictly increasing."""
    uri: str
    """URL of the version folder, e.g. ``"s3://bucket/run/weights/v00000007"``."""
    manifest: WeightManifest
    """Tensor names, shapes, dtypes and file checksums."""
    created_at: float
    """Publication time, seconds since the Unix epoch."""


class Pending(Protocol):
    """A call in progress (an actor call in async mode): ``done()`` never blocks, ``result()`` may."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class Ready:
    """A ``Pending`` that already has its result (a local call)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        """Always True."""
        return True

    def result(self) -> Any:
        """The value given at construction."""
        return self.value
