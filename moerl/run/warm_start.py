"""The checkpoint RL starts from: ``init_from``; else ``model.path`` itself with ``sft.steps=0``; else an SFT
warm start in ``RUN_DIR/sft``."""

from __future__ import annotations

from pathlib import Path

from moerl.config import ConfigError, RunConfig
from moerl.rundir.folder import RunDir
from moerl.tasks import sft
from moerl.telemetry.live import LiveView


def fine_tunes(cfg: RunConfig) -> bool:
    """Whether ``warm_start`` runs (or reuses) an SFT warm start: no ``init_from`` and ``sft.steps > 0``."""
    return cfg.init_from is None and cfg.sft.steps > 0


def warm_start(cfg: RunConfig, run: RunDir, view: LiveView) -> str | None:
    """The HF folder RL starts from: ``cfg.init_from``; else, with ``sft.steps == 0``, ``model.path`` as it
    is (no warm start; the config requires one of the two then); else an SFT warm start written to
    ``RUN_DIR/sft`` (reused when it already exists: resume).

    Raises:
        ConfigError: ``init_from`` is not a Hugging Face model folder.
    """
    if cfg.init_from is not None:
        if not (Path(cfg.init_from) / "config.json").exists():
            raise ConfigError(
                f"init_from={cfg.init_from!r} is not a Hugging Face model folder (no config.json)"
            )
        return cfg.init_from
    if not fine_tunes(cfg):  # sft.steps=0
        view.message(f"warm start skipped (sft.steps=0): RL starts from model.path={cfg.model.path!r}")
        return cfg.model.path
    out = run.path / "sft"
    if not (out / "config.json").exists():
        view.message(f"warm start: SFT for {cfg.sft.steps} steps -> {out}")
        sft.run_sft(cfg, out_dir=str(out), progress=view.warm_start_progress)
    return str(out)
