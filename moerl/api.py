"""moerl from Python: the functions a notebook or a script calls instead of the ``moerl`` command.

    from moerl.api import train

    summary = train("hf_parquet.yaml", trainer__steps=20, runtime__mode="sync")  # in examples/
    print(summary["final_eval_accuracy"], summary["policy"])

Import from ``moerl.api``, not ``moerl``: ``moerl.train`` and ``moerl.generate`` are modules (the run and
``moerl generate``), so a function of the same name on the package would be replaced by the submodule
the first time it is imported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from moerl.config import ConfigError, RunConfig, load_config, with_import_dirs
from moerl.configlib import from_dict, to_dict

__all__ = ["nested_overrides", "resolve_config", "train"]


def nested_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Keyword overrides as a nested dict to merge into a config: ``trainer__steps=5`` (a double
    underscore between a section and its field, as ``--set trainer.steps=5``) becomes
    ``{"trainer": {"steps": 5}}``; a name without ``__`` is a top-level field (``seed=1``).

    Values are Python values (int, float, str, bool, None, list, dict), taken as they are: no YAML
    parsing, so ``name="007"`` stays a string.

    Raises:
        ConfigError: a name with an empty part (``trainer__``, ``__steps``).
    """
    nested: dict[str, Any] = {}
    for name, value in overrides.items():
        parts = name.split("__")
        if not all(parts):
            raise ConfigError(f"override {name}=...: write section__field, e.g. trainer__steps=5")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Deep-merge ``new`` into ``into`` in place (``new`` wins on a leaf; a dict given for a section is
    merged into it, as ``--set 'model={hidden_size: 32}'`` is)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def resolve_config(config: str | Path | dict | RunConfig | None, **overrides: Any) -> RunConfig:
    """The run config that ``train(config, **overrides)`` runs, validated, nothing started.

    Args:
        config: a YAML file (``str`` or ``Path``, read as ``moerl train --config`` reads it: the reward
            module is also looked for in the file's folder), a nested dict of the same shape as the YAML,
            a ``RunConfig`` (copied, never changed), or None for the built-in defaults.
        **overrides: ``section__field=value`` (see ``nested_overrides``).

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a wrong type or an out-of-range value.
        FileNotFoundError: ``config`` names a file that does not exist.
        TypeError: ``config`` is none of the above.
    """
    path = None
    if config is None or isinstance(config, (str, Path)):
        path = None if config is None else Path(config)
        data = to_dict(load_config(path))
    elif isinstance(config, RunConfig):
        data = to_dict(config)
    elif isinstance(config, dict):
        data = copy.deepcopy(config)
    else:
        raise TypeError(f"config: a YAML path, a dict or a RunConfig, not {type(config).__name__}")
    _merge(data, nested_overrides(overrides))
    return with_import_dirs(from_dict(RunConfig, data), path)


def train(config: str | Path | dict | RunConfig | None = None, **overrides: Any) -> dict:
    """Run RL training as ``moerl train --config CONFIG --set section.field=value ...`` does, in this
    process, with the console's progress line; returns the run's summary.

    Example: ``train("hf_parquet.yaml", trainer__steps=5)`` is
    ``moerl train -c hf_parquet.yaml --set trainer.steps=5``.

    Args:
        config: a YAML path, a nested dict, a ``RunConfig`` or None (built-in defaults); see
            ``resolve_config``.
        **overrides: ``section__field=value``, e.g. ``trainer__steps=5``, ``runtime__mode="sync"``,
            ``seed=1``.

    Returns:
        The run's summary, the dict written to ``RUN_DIR/summary.json``: ``status`` (``"completed"``, or
        ``"stopped"`` with ``stop_reason``), ``steps``, ``start_eval_accuracy`` / ``final_eval_accuracy``
        (held-out exact match, 0..1, or None), ``wall_time_s`` (s), ``tasks_duplicated`` / ``tasks_lost``
        (0 in a sound run), ``policy`` (the exported Hugging Face folder, ``RUN_DIR/policy``: its parent
        is the run folder), ... (``moerl.train.Run.finish``).

    Raises:
        ConfigError: a bad config or override (one line, before any work starts).
        FileNotFoundError: a missing config, dataset or model folder.
        moerl.run.interrupt.RunInterrupted: Ctrl-C or SIGTERM during the run.
        moerl.errors.RewardFunctionError: the reward function failed (exit codes: docs/commands.md).
    """
    import moerl.train as run  # here: loads torch and the runtime

    return run.train(resolve_config(config, **overrides))
