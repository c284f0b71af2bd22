"""Step-record loggers: ``telemetry.loggers: [jsonl, tensorboard, wandb]``.

``metrics.jsonl`` (``moerl.telemetry.metrics.MetricsWriter``) is always written: it is the run's record
that ``moerl report`` and ``--resume`` read. ``Loggers`` sends the same records to TensorBoard
(``torch.utils.tensorboard``, event files in ``RUN_DIR/tensorboard``; extra ``tensorboard``) and to
Weights & Biases (offline by default: ``RUN_DIR/wandb/offline-run-*``, upload later with ``wandb
sync``; extra ``wandb``), under the metric families users of verl and slime know (``logger_name``):

    rollout/  rewards, lengths, buffer and queue depth, staleness, the rollout fleet, per-worker rates
    train/    losses, clip fraction, KL, entropy, grad norm, router balance, policy version
    perf/     throughput (tokens/s) and step time
    timing/   seconds of generation, training, publication, waiting
    eval/     held-out accuracy

Per-worker entries of ``rollout/workers`` become one scalar per field: ``rollout/worker_<id>_tokens_per_s``, ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from moerl.config import ConfigError, TelemetryConfig
from moerl.telemetry.metrics import WORKER_FIELDS, WORKERS_KEY

FAMILIES = ("rollout/", "train/", "perf/", "timing/", "eval/")
"""Prefixes of every name a logger receives."""

_RENAMES = {
    "buffer/": "rollout/buffer_",
    "queue/": "rollout/queue_",
    "fleet/": "rollout/fleet_",
    "ep/": "perf/ep_",
    "weights/": "rollout/weights_",
    "env/": "rollout/env_",
    "reward/": "rollout/reward_model_",
}


def logger_name(key: str) -> str:
    """The logger name of a ``metrics.jsonl`` key: ``buffer/depth`` -> ``rollout/buffer_depth``,
    ``fleet/killed`` -> ``rollout/fleet_killed``, ``policy_version`` -> ``train/policy_version``;
    names already in a family are kept.

    Raises:
        KeyError: a key that maps into no family.
    """
    if key == "policy_version":
        return "train/policy_version"
    for old, new in _RENAMES.items():
        if key.startswith(old):
            return new + key.removeprefix(old)
    if key.startswith(FAMILIES):
        return key
    raise KeyError(f"metric {key!r} maps into none of the families {FAMILIES}")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a ``metrics.jsonl`` record under their logger names (``None`` dropped;
    ``step`` and ``wall_s`` are the logger's own axes and left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "wall_s") or value is None:
            continue
        if key == WORKERS_KEY:
            for wid, entry in sorted(value.items()):
                for name in WORKER_FIELDS:
                    if entry.get(name) is not None:
                        out[f"rollout/worker_{wid}_{name}"] = float(entry[name])
            continue
        out[logger_name(key)] = float(value)
    return out


class Logger(Protocol):
    """A sink of step records."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Write one step's scalars (logger names, see ``scalars``)."""

    def close(self) -> None:
        """Flush and release files, processes and sockets."""


class TensorBoardLogger:
    """Scalars as TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``) in ``log_dir``.

    Raises:
        ConfigError: the ``tensorboard`` package (extra ``tensorboard``) is not installed.
    """

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package
        except ImportError as e:
            raise ConfigError(
                "telemetry.loggers has tensorboard but the tensorboard package is not installed "
                "(pip install 'moerl[tensorboard]')"
            ) from e
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """Scalars as a W&B run (``wandb.init``; ``mode="offline"`` writes ``dir/wandb/offline-run-*``).

    Args:
        folder: parent of the ``wandb`` folder (the run folder).
        project: W&B project.
        name: run name (the run folder's name).
        mode: ``offline`` or ``online``.
        config: the resolved run config (logged with the run).

    Raises:
        ConfigError: the ``wandb`` package (extra ``wandb``) is not installed.
    """

    def __init__(self, folder: str | Path, *, project: str, name: str, mode: str, config: dict) -> None:
        try:
            import wandb  # optional dependency, heavy: imported only when configured
        except ImportError as e:
            raise ConfigError(
                "telemetry.loggers has wandb but the wandb package is not installed (pip install 'moerl[wandb]')"
            ) from e
        os.environ.setdefault("WANDB_SILENT", "true")
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(folder),
            mode=mode,
            config=config,
            settings=settings,
            reinit="create_new",
        )
        self.run_dir = Path(self._run.dir).parent
        """The W&B run's folder (``.../wandb/offline-run-<time>-<id>``)."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class Loggers:
    """The configured loggers other than jsonl; ``log`` sends one ``metrics.jsonl`` record to each.

    Args:
        cfg: ``telemetry`` config.
        run_path: the run folder.
        run_config: the resolved run config as a dict (for W&B).
    """

    def __init__(self, cfg: TelemetryConfig, run_path: str | Path, run_config: dict | None = None) -> None:
        run_path = Path(run_path)
        self.loggers: list[Logger] = []
        try:
            if "tensorboard" in cfg.loggers:
                self.loggers.append(TensorBoardLogger(run_path / "tensorboard"))
            if "wandb" in cfg.loggers:
                self.loggers.append(
                    WandbLogger(
                        run_path,
                        project=cfg.wandb_project,
                        name=run_path.name,
                        mode=cfg.wandb_mode,
                        config=run_config or {},
                    )
                )
        except BaseException:
            self.close()
            raise

    def log(self, record: Mapping[str, Any]) -> None:
        """Send a ``metrics.jsonl`` record (``step`` and the fixed keys) to every logger."""
        values = scalars(record)
        for logger in self.loggers:
            logger.log(int(record["step"]), values)

    def close(self) -> None:
        """Close every logger (idempotent)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()
