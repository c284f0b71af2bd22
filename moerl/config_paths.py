"""Input paths of a run config resolved beside the config file: ``resolve_paths`` (called by
``moerl.config.with_import_dirs``, so by ``moerl train``, ``moerl sft`` and ``moerl.api``); re-exported by
``moerl.config``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moerl.configlib import ConfigError

if TYPE_CHECKING:
    from moerl.config import RunConfig

INPUT_PATHS = ("model.path", "init_from", "task.path", "task.val_path", "task.tokenizer", "reward.model_path")
"""The config fields naming files or folders a run reads (``resolve_paths``); ``output_dir`` is not one:
a run writes where it is started."""


def _resolve_one(name: str, value: str, folders: list[Path]) -> str:
    """``value`` made absolute: the first of ``folders / value`` that exists (``value`` itself when absolute
    or a URL ``scheme://...``, left to the checks that read it)."""
    if "://" in value or Path(value).expanduser().is_absolute():
        return value
    tried = [folder / Path(value).expanduser() for folder in folders]
    hit = next((t for t in tried if t.exists()), None)
    if hit is None:
        where = ", ".join(str(t) for t in dict.fromkeys(tried))
        raise ConfigError(f"{name}={value!r}: no such file or folder (tried {where})")
    return str(hit)


def resolve_paths(cfg: RunConfig, config_path: str | Path | None) -> RunConfig:
    """Make every relative path of ``INPUT_PATHS`` absolute: against the config file's folder first, then
    the working folder (the working folder alone without a config file), so that a config runs the same
    from anywhere. Returns ``cfg``, changed in place (the run folder's config.yaml keeps absolute paths).

    Raises:
        ConfigError: a relative path found in neither folder; the one line names every path tried.
    """
    folders = [Path(config_path).resolve().parent] if config_path is not None else []
    folders.append(Path.cwd())
    for dotted in INPUT_PATHS:
        section, _, field_name = dotted.rpartition(".")
        owner = getattr(cfg, section) if section else cfg
        value = getattr(owner, field_name)
        if isinstance(value, str):
            setattr(owner, field_name, _resolve_one(dotted, value, folders))
        elif isinstance(value, dict):
            setattr(
                owner, field_name, {k: _resolve_one(f"{dotted}.{k}", v, folders) for k, v in value.items()}
            )
        elif isinstance(value, tuple):
            setattr(
                owner,
                field_name,
                tuple(_resolve_one(f"{dotted}[{i}]", v, folders) for i, v in enumerate(value)),
            )
    return cfg
