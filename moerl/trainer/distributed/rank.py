"""The process of one training rank: join the group, build the sharded policy, serve the driver's commands.

Each rank runs ``serve`` in its own process (a local process in sync mode, a Ray actor in async
mode). The driver (``TrainerGroup``) sends every rank the same command in the same order, so the
collectives inside a command line up across ranks; every collective has the group's timeout.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.config import RunConfig
from moerl.ep.traffic import DirectionTraffic, dispatcher_traffic, model_dispatchers, traffic_delta
from moerl.trainer.batch import TrainBatch
from moerl.trainer.distributed.algo_models import build_algo_models
from moerl.trainer.distributed.checkpoint import (
    ShardedCheckpointError,
    load_critic_scheduler,
    load_sharded,
    save_sharded,
    set_lr_from_scheduler,
)
from moerl.trainer.distributed.export import export_sharded
from moerl.trainer.distributed.mesh import COLLECTIVE_TIMEOUT_S, build_mesh, init_group
from moerl.trainer.distributed.parallelize import build_sharded_policy
from moerl.trainer.distributed.publish import iter_full_tensors, publish_sharded, stream_sharded
from moerl.trainer.distributed.sharded import ShardedTrainer
from moerl.trainer.local import NonFiniteLossError
from moerl.weights.buckets import StreamedVersion
from moerl.weights.store import WeightStore

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainerRankError(RuntimeError):
    """A training rank died, hung past the collective timeout, or failed (the message names it)."""


def unwrap_reply(reply: tuple[str, Any]) -> Any:
    """The value of a rank's ``("ok", value)`` reply; re-raises a ``("raise", exception)``; raises
    ``TrainerRankError`` with the rank's traceback text for ``("error", text)``."""
    kind, value = reply
    if kind == "ok":
        return value
    if kind == "raise":
        raise value
    raise TrainerRankError(value)


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank process needs to join the group and build its shard."""

    rank: int
    """Global rank."""
    num_ranks: int
    """Group size."""
    init_method: str
    """Rendezvous URL (``file://`` for local processes, ``tcp://host:port`` across machines)."""
    cfg: RunConfig
    """The run config (trainer, algorithm, rollout temperature, runtime.publish_bucket_mb)."""
    init_path: str
    """Hugging Face folder the policy is loaded from (each rank reads only its shard)."""
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Timeout of every collective."""


class RankTrainer:
    """One rank: its mesh, sharded policy and ``ShardedTrainer``; methods are the driver's commands."""

    def __init__(self, spec: RankSpec) -> None:
        cfg = spec.cfg
        device = torch.device(cfg.model.device)
        if device.type == "cuda":
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        init_group(
            "nccl" if device.type == "cuda" else "gloo",
            spec.init_method,
            spec.rank,
            spec.num_ranks,
            timeout_s=spec.timeout_s,
        )
        t = cfg.trainer
        self.mesh = build_mesh(t.ep_size, t.gpus_per_node, device.type)
        shards = {"ep_dispatcher": t.ep_dispatcher, "dtype": _DTYPES[cfg.model.dtype], "device": device}
        model = build_sharded_policy(spec.init_path, self.mesh, **shards)
        # the reference policy and the critic's value model, sharded alike from the same start folder
        others = build_algo_models(spec.init_path, self.mesh, cfg.algorithm, **shards)
        self.trainer = ShardedTrainer(
            model,
            t,
            cfg.algorithm,
            self.mesh,
            temperature=cfg.rollout.temperature,
            norm_length=cfg.algorithm.norm_length or cfg.rollout.max_new_tokens,
            **others,
        )
        # the EP dispatchers of every model of the step (policy, reference, critic): [] without EP
        self.dispatchers = model_dispatchers(model, *others.values())
        self.bucket_bytes = int(cfg.runtime.publish_bucket_mb * 2**20)
        self.keep_versions = cfg.runtime.keep_versions

    def counters(self) -> dict[str, int]:
        """step, nan_streak, num_skipped, version_offset."""
        t = self.trainer
        return {
            "step": t.step,
            "nan_streak": t.nan_streak,
            "num_skipped": t.num_skipped,
            "version_offset": t.version_offset,
        }

    def train_step(self, batch: TrainBatch):
        """``ShardedTrainer.train_step`` on this rank's slice; (TrainStats, counters, EP traffic): the
        bytes this rank's dispatchers sent during the step, by direction (``moerl.ep.traffic``; None: no EP)."""
        before = dispatcher_traffic(self.dispatchers)
        stats = self.trainer.train_step(batch)
        return stats, self.counters(), traffic_delta(dispatcher_traffic(self.dispatchers), before)

    def ep_traffic(self) -> DirectionTraffic | None:
        """This rank's dispatchers' cumulative counters since the rank started (None: no EP)."""
        return dispatcher_traffic(self.dispatchers)

    def publish(self, store_url: str, version: int):
        """Gather and write ``version`` bucket by bucket; rank 0 returns the ``WeightVersion``."""
        store = WeightStore(store_url, keep=self.keep_versions) if self.mesh.rank == 0 else None
        return publish_sharded(self.trainer.model, self.mesh, store, version, self.bucket_bytes)

    def stream(self, version: int, sink) -> StreamedVersion | None:
        """Gather ``version`` bucket by bucket; rank 0 packs each and hands it to ``sink.send`` (a
        ``moerl.weights.transport.BucketSink``: ``ray.put`` and offers, or a collective broadcast) as
        soon as it is gathered (``stream_sharded``); rank 0 returns what was sent."""
        return stream_sharded(self.trainer.model, self.mesh, version, self.bucket_bytes, sink.send)

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole state dict gathered (rank 0; None elsewhere)."""
        out = {}
        for name, t in iter_full_tensors(self.trainer.model):
            if self.mesh.rank == 0:
                out[name] = t
        return out if self.mesh.rank == 0 else None

    def export(self, folder: str) -> None:
        """Write the policy as a Hugging Face folder at ``folder`` (rank 0 writes, bucket by bucket)."""
        export_sharded(
            self.trainer.model, folder, is_writer=self.mesh.rank == 0, bucket_bytes=self.bucket_bytes
        )

    def save(self, folder: str) -> dict:
        """Write this rank's shards of the model and optimizer (and critic) into the DCP folder ``folder``;
        returns the LR schedulers' states (``critic_scheduler`` with a critic) and the counters."""
        save_sharded(self.trainer, folder)
        critic = self.trainer.algo.critic
        extra = {} if critic is None else {"critic_scheduler": critic.scheduler.state_dict()}
        return {"scheduler": self.trainer.scheduler.state_dict(), **extra, **self.counters()}

    def load(
        self, folder: str, scheduler: dict, counters: dict, critic_scheduler: dict | None = None
    ) -> dict:
        """Read model and optimizer (and critic) shards from the DCP folder (any saved world size)."""
        load_sharded(self.trainer, folder)
        self.trainer.scheduler.load_state_dict(scheduler)
        set_lr_from_scheduler(self.trainer)
        load_critic_scheduler(self.trainer, critic_scheduler)
        self.set_counters(counters)
        return self.counters()

    def set_counters(self, counters: dict) -> dict:
        """Set step, nan_streak, num_skipped, version_offset."""
        t = self.trainer
        t.step, t.nan_streak, t.num_skipped = (
            counters["step"],
            counters["nan_streak"],
            counters["num_skipped"],
        )
        t.version_offset = counters.get("version_offset", 0)
        return self.counters()

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _reply(conn, kind: str, value: Any) -> None:
    conn.send((kind, value))


def serve_in_env(environ: dict[str, str], spec: RankSpec, conn) -> None:
    """``serve`` under ``environ``, the driver's environment when it started this rank: a rank forked from
    a fork server (``moerl.trainer.distributed.group``) otherwise keeps the server's environment of its
    own start, where a ``spawn``ed one would have the driver's (``MOERL_RANK_THREADS``, ``CUDA_*``)."""
    os.environ.clear()
    os.environ.update(environ)
    serve(spec, conn)


def serve(spec: RankSpec, conn) -> None:
    """Entry point of a local rank process: build the rank, then answer ``(method, args)`` messages on
    ``conn`` with ``("ok", result)``, ``("raise", exception)`` or ``("error", traceback text)`` until
    ``("close", ())``. Exits with code 0 after close, 1 after an error."""
    torch.set_num_threads(max(1, int(os.environ.get("MOERL_RANK_THREADS", "1"))))
    try:
        rank = RankTrainer(spec)
    except BaseException:
        _reply(conn, "error", f"trainer rank {spec.rank} failed to start:\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    _reply(conn, "ok", rank.counters())
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the driver is gone
            rank.close()
            raise SystemExit(1) from None
        if method == "close":
            rank.close()
            _reply(conn, "ok", None)
            return
        try:
            _reply(conn, "ok", getattr(rank, method)(*args))
        except (NonFiniteLossError, ShardedCheckpointError) as e:  # the driver re-raises these as they are
            _reply(conn, "raise", e)
        except BaseException:
            _reply(conn, "error", f"trainer rank {spec.rank}, {method}:\n{traceback.format_exc()}")
            rank.close()
            raise SystemExit(1) from None


def write_file_url(folder: Path) -> str:
    """A ``file://`` rendezvous URL in ``folder`` (the store file must not exist yet)."""
    return f"file://{folder.resolve()}/rendezvous"
