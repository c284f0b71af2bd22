"""The run's trainer from its config: today's one-process ``Trainer`` at ``trainer.num_ranks=1``, else a
``TrainerGroup``; and checkpoint loading that works across world sizes for both."""

from __future__ import annotations

from pathlib import Path

import torch

from moerl.config import ConfigError, RunConfig
from moerl.placement import IN_DRIVER, LOCAL_PROCESSES, RAY_ACTORS, Placement
from moerl.trainer.distributed.checkpoint import (
    ShardedCheckpointError,
    load_critic_scheduler,
    load_sharded,
    set_lr_from_scheduler,
)
from moerl.trainer.distributed.group import TrainerGroup
from moerl.trainer.local import LocalTrainer


def check_trainer_resources(cfg: RunConfig) -> None:
    """Before any warm start or launch: a CUDA policy needs one GPU per local rank.

    Raises:
        ConfigError: ``trainer.num_ranks`` is larger than the GPUs this machine has (sync mode: the
            ranks are local processes), or one rank's ``model.device`` (``cuda:N``) is not on it.
    """
    placed = Placement.from_config(cfg).trainer
    device = torch.device(cfg.model.device)  # its form is checked at load: cpu, cuda, cuda:N
    if (
        placed.ranks_run_on == IN_DRIVER
        and device.type == "cuda"
        and (device.index or 0) >= torch.cuda.device_count()
    ):
        raise ConfigError(  # the trainer runs in this process (sync and async mode alike)
            f"model.device={cfg.model.device} needs a GPU (trainer.num_ranks=1) but this machine has "
            f"{torch.cuda.device_count()}; use model.device=cpu"
        )
    if placed.ranks_run_on == LOCAL_PROCESSES and device.type == "cuda":
        available = torch.cuda.device_count()
        if placed.num_ranks > available:
            raise ConfigError(
                f"trainer.num_ranks={placed.num_ranks} needs {placed.num_ranks} GPUs (one per rank) but this machine has "
                f"{available}; lower trainer.num_ranks or use model.device=cpu"
            )


def make_trainer(
    cfg: RunConfig,
    model: torch.nn.Module | None,
    init_path: str | None,
    scratch: Path,
    *,
    keep_copy: bool = True,
) -> LocalTrainer | TrainerGroup:
    """The trainer of the run.

    Args:
        cfg: the run config.
        model: the driver's policy (trained in place at one rank; refreshed from each publish otherwise);
            None: the driver has none (a trainer group loading ``init_path``, or its saved fresh copy).
        init_path: Hugging Face folder of the starting weights; None: ``model`` is a fresh model, which
            is saved under ``scratch`` for the ranks to load their shards from.
        scratch: a folder of the run for that copy.
        keep_copy: a trainer group keeps ``model`` as the driver's copy (eval, refreshed from each
            publish); False: ``model`` only seeds the ranks (async mode: a rollout worker evaluates).

    Raises:
        RuntimeError: async mode with ``trainer.num_ranks > 1`` before the run's Ray instance is up
            (``moerl.runtime.ray.init_ray``; the trainer sits below the runtime and does not start it).
    """
    placed = Placement.from_config(cfg).trainer
    ranks_run_on = placed.ranks_run_on
    if ranks_run_on == IN_DRIVER:
        return LocalTrainer.from_run_config(model, cfg)
    if init_path is None:  # a fresh policy: saved once, so that a restarted group loads the same weights
        from moerl.models import save_pretrained

        init_path = str(scratch / "trainer_init")
        if not (Path(init_path) / "config.json").exists():
            save_pretrained(model, init_path)
    if ranks_run_on == RAY_ACTORS:
        import ray  # here: Ray only in async mode

        if not ray.is_initialized():  # ray.remote would start an instance the rollout fleet cannot share
            raise RuntimeError("async mode: the run's Ray instance must be up (moerl.runtime.ray.init_ray)")
        return TrainerGroup(
            cfg,
            init_path,
            model if keep_copy else None,
            num_ranks=placed.num_ranks,
            ranks="ray",
            timeout_s=cfg.trainer.collective_timeout_s,
        )
    return TrainerGroup(
        cfg,
        init_path,
        model if keep_copy else None,
        num_ranks=placed.num_ranks,
        timeout_s=cfg.trainer.collective_timeout_s,
    )


def load_trainer_state(trainer: LocalTrainer | TrainerGroup, folder: Path, parts: dict) -> None:
    """Restore ``trainer`` from the checkpoint step folder ``folder`` (read as ``parts``), whichever number
    of ranks wrote it.

    Raises:
        ConfigError: the checkpoint's shards do not match the model (names the tensor and both shapes),
            or a one-rank checkpoint resumed with ``trainer.num_ranks > 1`` (not supported yet).
    """
    try:
        _load_trainer_state(trainer, Path(folder), parts)
    except ShardedCheckpointError as e:
        raise ConfigError(
            f"{e} (resume with the run's own model: the checkpoint's shards do not fit this one)"
        ) from None


def _load_trainer_state(trainer: LocalTrainer | TrainerGroup, folder: Path, parts: dict) -> None:
    sharded = parts.get("sharded")
    if isinstance(trainer, TrainerGroup):
        if sharded is None:
            raise ConfigError(
                f"{folder} was written by a one-rank trainer; resume it with trainer.num_ranks=1 "
                "(a sharded resume needs a sharded checkpoint)"
            )
        trainer.load_checkpoint_folder(Path(folder), parts)
        if trainer.model is not None:
            trainer.model.load_state_dict(trainer.named_weights())
        return
    if sharded is None:
        trainer.load_state_dict(parts)
        return
    load_sharded(trainer, Path(folder).parent / sharded["path"])
    trainer.scheduler.load_state_dict(parts["scheduler"])
    set_lr_from_scheduler(trainer)
    load_critic_scheduler(trainer, parts.get("critic_scheduler"))
    counters = parts["trainer"]
    trainer.step, trainer.nan_streak, trainer.num_skipped = (
        counters["step"],
        counters["nan_streak"],
        counters["num_skipped"],
    )
    trainer.version_offset = counters.get("version_offset", 0)


def trainer_summary(trainer: LocalTrainer | TrainerGroup) -> dict:
    """``trainer_ranks`` and ``trainer_rank_pids`` (the driver's pid for the one-process trainer)."""
    return {"trainer_ranks": trainer.num_ranks, "trainer_rank_pids": trainer.pids}


def record_ranks(trainer: LocalTrainer | TrainerGroup, run_dir: Path) -> None:
    """Write ``RUN_DIR/trainer_ranks.json`` ({"num_ranks", "pids"}) atomically: which processes train."""
    import json

    path = Path(run_dir) / "trainer_ranks.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(
        json.dumps(
            {
                "num_ranks": trainer_summary(trainer)["trainer_ranks"],
                "pids": trainer_summary(trainer)["trainer_rank_pids"],
            }
        )
    )
    tmp.replace(path)
