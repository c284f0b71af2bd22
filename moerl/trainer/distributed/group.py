"""``TrainerGroup``: R training ranks driven as one trainer, with the interface of ``Trainer``.

The driver (the controller's process) holds no shard. Each step it builds the batch (advantages over
the whole batch), cuts it into R slices of whole groups (``split_by_groups``), sends rank r its
slice and waits for all R replies. Publishing, checkpointing and loading are commands every rank
runs together (their collectives line up). In sync mode the ranks are local processes started here
(``multiprocessing`` fork server, no Ray); ``runtime.mode=async`` uses Ray actors (``moerl.trainer.distributed.ray_ranks``)
behind the same ``RankHandle`` interface.

Failure: a rank that exits, or a reply that does not come within the collective timeout plus a
margin, raises ``TrainerRankError`` naming the rank and its pid; the caller tears the group down
(``close``) and starts a new one from the newest checkpoint.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from moerl.config import RunConfig
from moerl.ep.traffic import DirectionTraffic, sum_traffic
from moerl.records import Group, WeightVersion
from moerl.rl import preset_from_config
from moerl.trainer.batch import TrainBatch, build_train_batch
from moerl.trainer.checkpoint import capture_rng_state, list_checkpoints, save_checkpoint
from moerl.trainer.distributed.batching import split_by_groups
from moerl.trainer.distributed.mesh import COLLECTIVE_TIMEOUT_S
from moerl.trainer.distributed.rank import (
    RankSpec,
    TrainerRankError,
    serve_in_env,
    unwrap_reply,
    write_file_url,
)
from moerl.trainer.distributed.ray_ranks import RayRanks
from moerl.trainer.local import TrainStats
from moerl.weights.buckets import StreamedVersion, unpack_bucket
from moerl.weights.store import WeightStore

SHARDS_DIR = "shards"
"""Sub-folder of ``RUN_DIR/checkpoints`` with the DCP folder of each checkpoint step."""


RANK_PRELOAD = ["torch._dynamo", "moerl.trainer.distributed.rank"]
"""What the fork server of local ranks imports once: torch, FSDP2 and DTensor, moerl's trainer, and
``torch._dynamo``, which torch imports lazily at a process's first meta-device op (``build_sharded_policy``
builds the model on the meta device): 1-2 s of CPU that every rank of every group paid again."""


def _rank_context() -> mp.context.ForkServerContext:
    """The context local ranks start from: a fork server that imported ``RANK_PRELOAD`` once, so each rank
    (and each group restarted after a failure) forks from it instead of importing torch, DTensor and
    the trainer again (seconds of CPU a process, the rank start's whole cost on CPU). The server is
    single-threaded, holds no process group and never initializes CUDA, so a fork of it is as clean as
    a ``spawn``ed process; each rank takes the driver's environment of the moment (``serve_in_env``).
    One server per driver process, started by the first group (a later preload list is not used)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


class LocalRanks:
    """R rank processes on this machine (forked from ``_rank_context``'s server), one duplex pipe each."""

    def __init__(self, specs: list[RankSpec]) -> None:
        ctx = _rank_context()
        self.conns, self.procs = [], []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve_in_env,
                args=(dict(os.environ), spec, child),
                name=f"moerl-trainer-rank{spec.rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        """Process id of each rank."""
        return [p.pid for p in self.procs]

    def send(self, method: str, per_rank_args: Sequence[tuple]) -> None:
        for conn, args in zip(self.conns, per_rank_args, strict=True):
            conn.send((method, args))

    def gather(self, timeout_s: float) -> list[Any]:
        """Every rank's reply, rank order; raises ``TrainerRankError`` on a death, an error or a timeout."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.conns):
            waiting = {c: r for r, c in enumerate(self.conns) if r not in replies}
            sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
            ready = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(waiting.values())
                raise TrainerRankError(
                    f"trainer ranks {late} (pids {[self.pids[r] for r in late]}) did not answer within {timeout_s:.0f} s"
                )
            for obj in ready:
                if obj in waiting:
                    r = waiting[obj]
                    try:
                        replies[r] = unwrap_reply(obj.recv())
                    except EOFError:
                        raise self._died(r) from None
            for obj in ready:
                if (
                    obj in sentinels
                    and sentinels[obj] not in replies
                    and not self.conns[sentinels[obj]].poll()
                ):
                    raise self._died(sentinels[obj])
        return [replies[r] for r in range(len(self.conns))]

    def _died(self, r: int) -> TrainerRankError:
        self.procs[r].join(1.0)
        return TrainerRankError(
            f"trainer rank {r} (pid {self.pids[r]}) died (exit code {self.procs[r].exitcode})"
        )

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every live rank to leave, then kill those still running after ``timeout_s`` (own children only)."""
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(("close", ()))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


class TrainerGroup:
    """The policy trained by ``num_ranks`` ranks; used like ``moerl.trainer.local.Trainer``.

    Args:
        cfg: the run config.
        num_ranks: training processes (``moerl.placement.TrainerPlacement.num_ranks``; ``batch_groups``
            and ``ep_size`` divide it, as ``RunConfig`` checks for ``trainer.num_ranks``).
        init_path: Hugging Face folder the ranks load their shards from.
        model: the driver's copy of the policy (eval and export use it); refreshed from every
            version published to the store, and from a streamed one by ``refresh_model``. None: no copy kept.
        timeout_s: collective timeout of the ranks: a rank waiting longer for a peer (hung or dead)
            raises, and its error reaches the driver.
        startup_s: how long the driver waits for the ranks to start (imports, rendezvous, loading).
        reply_timeout_s: how long the driver waits for any other command's replies (a whole step);
            None: 10 x ``timeout_s``.
        ranks: ``"local"``: local processes (sync mode); ``"ray"``: Ray actors in a placement group.

    Raises:
        TrainerRankError: a rank failed to start (its traceback is in the message).
    """

    def __init__(
        self,
        cfg: RunConfig,
        init_path: str,
        model: torch.nn.Module | None = None,
        *,
        num_ranks: int,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        startup_s: float = 120.0,
        reply_timeout_s: float | None = None,
        ranks: str = "local",
    ) -> None:
        self.cfg, self.model = cfg, model
        self.num_ranks = num_ranks
        self.preset = preset_from_config(cfg.algorithm)
        self.timeout_s = reply_timeout_s if reply_timeout_s is not None else 10 * timeout_s
        self._rendezvous = Path(tempfile.mkdtemp(prefix="moerl-trainer-"))
        specs = [
            RankSpec(r, self.num_ranks, write_file_url(self._rendezvous), cfg, str(init_path), timeout_s)
            for r in range(self.num_ranks)
        ]
        if ranks == "ray":  # RayRanks imports Ray only when built
            self.ranks = RayRanks(cfg, specs)
        else:
            self.ranks = LocalRanks(specs)
        try:
            self._counters = self.ranks.gather(timeout_s + startup_s)[0]
        except BaseException:
            self.close()
            raise
        self._weights: tuple[int, dict[str, torch.Tensor]] | None = None
        self._streamed: StreamedVersion | None = None  # the last version streamed to the workers
        self._model_version = -1  # version of the driver's copy of the policy
        self.last_ep_traffic: DirectionTraffic | None = None
        """EP bytes of the last ``train_step``, summed over all ranks (every byte any rank sent to another
        rank, so the figure of the whole group, not of rank 0), by direction and link class (``moerl.ep.
        traffic``); forwards and backward passes of the policy, reference and critic. None: no EP."""

    # -- the Trainer interface -----------------------------------------------------------------

    @property
    def step(self) -> int:
        """Trainer steps taken."""
        return self._counters["step"]

    @property
    def version_offset(self) -> int:
        """Policy version minus step (raised by a restart)."""
        return self._counters["version_offset"]

    @version_offset.setter
    def version_offset(self, value: int) -> None:
        self._counters = self._all("set_counters", {**self._counters, "version_offset": value})[0]

    @property
    def version(self) -> int:
        """Policy version of the current weights."""
        return self.step + self.version_offset

    @property
    def num_skipped(self) -> int:
        """Skipped (non-finite) steps."""
        return self._counters["num_skipped"]

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (rank order)."""
        return self.ranks.pids

    def build_batch(self, groups: Sequence[Group], pad_id: int) -> TrainBatch:
        """``build_train_batch`` over all groups (advantages before the split)."""
        return build_train_batch(groups, pad_id=pad_id, estimator=self.preset.estimator)

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One trainer step of the group; rank r trains slice r (``split_by_groups``: part r of each of the
        ``trainer.mini_batches`` mini-batches).

        Raises:
            NonFiniteLossError: as ``Trainer.train_step``.
            TrainerRankError: a rank died, failed or timed out.
        """
        slices = split_by_groups(batch, self.num_ranks, self.cfg.trainer.mini_batches)
        self.ranks.send("train_step", [(s,) for s in slices])
        replies = self.ranks.gather(self.timeout_s)
        stats, self._counters, _ = replies[0]
        self.last_ep_traffic = sum_traffic(traffic for _, _, traffic in replies)
        return stats

    def publish(self, store: WeightStore) -> WeightVersion:
        """Write the current weights as version ``self.version``: gathered from the shards and written
        by rank 0 bucket by bucket (``runtime.publish_bucket_mb``); the driver's copy is refreshed."""
        version = self._all("publish", store.url, self.version)[0]
        self._weights = (self.version, store.load(self.version))
        self.refresh_model()
        return version

    def stream_buckets(self, sink, bucket_bytes: int) -> StreamedVersion:
        """Stream the current version to ``sink`` (a ``moerl.weights.transport.BucketSink``, pickled to
        rank 0): the ranks gather it bucket by bucket (``runtime.publish_bucket_mb``; ``bucket_bytes`` is
        the ranks' own) and rank 0 sends each packed bucket at once; nothing is written to the store and
        no process holds the whole model. The driver's copy of the policy is refreshed only when asked
        (``named_weights``, ``refresh_model``).

        Raises:
            TrainerRankError: a rank died, failed or timed out.
        """
        streamed = self._all("stream", self.version, sink)[0]
        # object-store refs can be read back for the driver's copy; a broadcast leaves none
        self._streamed = streamed if streamed.refs and all(r is not None for r in streamed.refs) else None
        return streamed

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full weights of the current version: read back from the last publish, or resolved from the
        last streamed version's bucket refs (zero-copy views of the object store's copies, read-only),
        else gathered."""
        if self._weights is None or self._weights[0] != self.version:
            streamed = self._streamed
            if streamed is not None and streamed.version == self.version:
                import ray  # lazy: only async runs stream

                tensors = {}
                for ref in streamed.refs:
                    tensors.update(unpack_bucket(ray.get(ref), verify=False))
                self._weights = (self.version, tensors)
            else:
                self._weights = (self.version, self._all("full_weights")[0])
        return self._weights[1]

    def ep_traffic_totals(self) -> list[DirectionTraffic | None]:
        """Each rank's dispatchers' cumulative EP counters since the group started (rank order)."""
        return self._all("ep_traffic")

    def refresh_model(self) -> None:
        """Bring the driver's copy of the policy (eval) to the current version, if it is behind."""
        if self.model is not None and self._model_version != self.version:
            self.model.load_state_dict(self.named_weights())
            self._model_version = self.version

    def checkpoint(self, run_dir: str | Path, extra: dict, *, keep: int = 2) -> Path:
        """Sharded model and optimizer (DCP, ``checkpoints/shards/step_<step>``) by the ranks, then the
        step folder (counters, scheduler, RNG, ``extra``) atomically by the driver, which commits it and
        records every shard file's size and xxh3-128 digest in its meta.json (reading the shards once)."""
        root = Path(run_dir) / "checkpoints"
        shards = root / SHARDS_DIR / f"step_{self.step}"
        shutil.rmtree(shards, ignore_errors=True)
        saved = self._all("save", str(shards))[0]
        part = {
            "path": f"{SHARDS_DIR}/step_{self.step}",
            "num_ranks": self.num_ranks,
            "ep_size": self.cfg.trainer.ep_size,
        }
        counters = {k: saved[k] for k in ("step", "nan_streak", "num_skipped", "version_offset")}
        path = save_checkpoint(
            run_dir,
            self.step,
            {
                "trainer": counters,
                "scheduler": saved["scheduler"],
                **({"critic_scheduler": saved["critic_scheduler"]} if "critic_scheduler" in saved else {}),
                "sharded": part,
                "rng": capture_rng_state(),
                **extra,
            },
            keep=keep,
        )
        kept = {f"step_{s}" for s, _ in list_checkpoints(run_dir)}
        for old in (root / SHARDS_DIR).iterdir():
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def load_checkpoint_folder(self, folder: Path, parts: dict) -> None:
        """Load a step folder written by ``checkpoint`` at any number of ranks."""
        shards = folder.parent / parts["sharded"]["path"]
        self._counters = self._all(
            "load", str(shards), parts["scheduler"], parts["trainer"], parts.get("critic_scheduler")
        )[0]

    def export_policy(self, folder: str | Path, extra: Callable[[Path], None] | None = None) -> Path:
        """Write the current policy as a Hugging Face folder, streamed from the shards (rank 0 writes one
        bucket at a time), ``extra(tmp)`` adding files (the tokenizer); replaces ``folder`` atomically."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self._all("export", str(tmp))
            if extra is not None:
                extra(tmp)
            for f in tmp.iterdir():  # shared outputs: readable by all, whatever the writer's umask
                f.chmod(0o644)
            old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
            if folder.exists():
                folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.close()
            self.ranks = None
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def _all(self, method: str, *args: Any) -> list[Any]:
        self.ranks.send(method, [args] * self.num_ranks)
        return self.ranks.gather(self.timeout_s)
