"""Checks of ``moerl train --resume`` before any long work: which ``--set`` fields a resume applies, and
which checkpoint it continues from.

A resumed run keeps its own config (``RUN_DIR/config.yaml``); a ``--set`` may change only the fields in
``RESUME_FIELDS`` (how long to train, how often to checkpoint or evaluate, where and on how many ranks or
workers it runs, telemetry, storage access, and a moved ``init_from``). Any other field would be
silently inconsistent with the checkpoint (a model size, a task, an algorithm setting), so it is refused
unless it equals the run's own value. A run's ``init_from`` is stored as an absolute path (``train``), so
a resume from another working folder finds it; the checkpoint is the newest complete one
(``moerl.trainer.checkpoint.newest_complete_checkpoint``); newer damaged ones are named with the reason.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moerl.config import ConfigError, RunConfig, load_config
from moerl.configlib import to_dict
from moerl.trainer.checkpoint import newest_complete_checkpoint, read_checkpoint_step

RESUME_FIELDS = (
    "trainer.steps",
    "trainer.checkpoint_every",
    "trainer.max_nan_steps",
    "trainer.num_ranks",
    "trainer.ep_size",
    "trainer.ep_dispatcher",
    "trainer.gpus_per_node",
    "trainer.activation_checkpointing",
    "trainer.background_publish",
    "eval.every",
    "init_from",
    "output_dir",
    "model.device",
    "rollout.num_workers",
    "runtime.ray_address",
    "runtime.keep_checkpoints",
    "runtime.keep_versions",
    "storage.options",
    "storage.retries",
    "fleet.*",
    "chaos.*",
    "telemetry.*",
)
"""Config fields a ``--set`` may change on resume (``section.*``: every field of the section)."""


def _is_resume_field(key: str) -> bool:
    section = key.split(".", 1)[0]
    return key in RESUME_FIELDS or f"{section}.*" in RESUME_FIELDS


def _value(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_resume_overrides(stored: RunConfig, resumed: RunConfig, overrides: list[str]) -> None:
    """Refuse a ``--set`` of a field that a resume does not apply.

    Args:
        stored: the run's own config (``RUN_DIR/config.yaml``).
        resumed: the same with ``overrides`` applied.
        overrides: the ``section.field=value`` items of the resume.

    Raises:
        ConfigError: an override of a field outside ``RESUME_FIELDS`` that changes its value (one line,
            naming the field and the fields a resume accepts).
    """
    before, after = to_dict(stored), to_dict(resumed)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if _is_resume_field(key) or _value(before, key) == _value(after, key):
            continue
        raise ConfigError(
            f"--set {key}: a resumed run keeps its own config ({key}={_value(before, key)!r}); a resume "
            f"accepts only {', '.join(RESUME_FIELDS)} (start a new run to change {key})"
        )


def resume_checkpoint(run_dir: str | Path, cfg: RunConfig) -> Path:
    """The newest complete checkpoint of ``run_dir``; prints one line for the newer ones it skips
    (``"moerl: checkpoints/step_200: model.safetensors unreadable (invalid header length); resuming from
    step_100"``). A file changed since the write (its size or xxh3-128 digest differs from meta.json's
    record, e.g. a model re-saved with other values) is damage too; every file is read once for that.

    Raises:
        FileNotFoundError: no complete checkpoint (says why: none written yet, checkpoints off, or each
            one's damage).
        ConfigError: ``trainer.steps`` is below that checkpoint's step (``check_resume_steps``).
    """
    ckpt, skipped = newest_complete_checkpoint(run_dir)
    if ckpt is not None:
        check_resume_steps(ckpt, cfg)
        for line in skipped:
            print(f"moerl: {line}; resuming from {ckpt.name}", file=sys.stderr)
        return ckpt
    if skipped:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint to resume from: {'; '.join(skipped)}")
    every = cfg.trainer.checkpoint_every
    raise FileNotFoundError(
        f"{run_dir} has no complete checkpoint to resume from (trainer.checkpoint_every={every}: "
        + ("checkpoints are off)" if every == 0 else f"the first is written at step {every})")
    )


def check_resume_steps(ckpt: Path, cfg: RunConfig) -> None:
    """Refuse a resume whose ``trainer.steps`` is below the step of checkpoint ``ckpt``: it would train
    nothing and report the run completed.

    Raises:
        ConfigError: naming ``trainer.steps``, the checkpoint and the least value that resumes.
    """
    if (step := read_checkpoint_step(ckpt)) > cfg.trainer.steps:
        raise ConfigError(
            f"trainer.steps={cfg.trainer.steps} is below the step of the checkpoint the run resumes from "
            f"({ckpt.name}): nothing would be trained; set trainer.steps >= {step}"
        )


def resumed_config(config_path: Path, overrides: list[str] | None) -> RunConfig:
    """The run's own config with the ``overrides`` a resume applies (``check_resume_overrides``).

    Raises:
        ConfigError: a bad override, or one of a field a resume does not apply.
    """
    cfg = load_config(config_path, overrides)
    check_resume_overrides(load_config(config_path), cfg, overrides or [])
    return cfg


def check_init_from(cfg: RunConfig, run_path: Path, config_path: Path) -> None:
    """A resume still builds the architecture, the tokenizer and the reference policy (KL) from
    ``init_from``: check it is there before any work. A relative one (a run started before init_from was
    stored absolute) is taken from the folder the run started in when the run's own relative
    ``output_dir`` says which (``<start>/<output_dir>/<run>``; ``cfg.init_from`` is then made absolute),
    else from the working folder.

    Raises:
        ConfigError: ``init_from`` is set and is not a Hugging Face model folder (no ``config.json``);
            the message says how to point to a moved folder.
    """
    init = cfg.init_from
    if init is None or "://" in init:
        return
    stored = load_config(config_path)  # as the run was started, not with a resume's --set
    if not Path(init).is_absolute() and init == stored.init_from:  # a --set one is relative to here
        out = Path(stored.output_dir)
        parents = Path(run_path).resolve().parents
        if not out.is_absolute() and ".." not in out.parts and len(out.parts) < len(parents):
            started_in = parents[len(out.parts)]
            if (started_in / init / "config.json").is_file():
                cfg.init_from = str(started_in / init)
                return
    if (Path(init) / "config.json").is_file():
        return
    where = f"relative to {os.getcwd()}, " if not Path(init).is_absolute() else ""
    raise ConfigError(
        f"init_from={init!r} (from {config_path if init == stored.init_from else '--set'}) is not a Hugging Face model folder ({where}no config.json); "
        "the resume builds the model, tokenizer and reference policy from it: --set init_from=PATH"
    )


@contextmanager
def removed_on_failure(fetched: Path | None) -> Iterator[None]:
    """Remove ``fetched`` (a run folder just fetched from storage for this resume) if the block fails:
    a remote resume that fails before training leaves no half-used copy behind. ``None``: a no-op."""
    try:
        yield
    except BaseException:
        if fetched is not None:
            shutil.rmtree(fetched, ignore_errors=True)
        raise
