"""User reward functions, selected by import path in the config (``task.reward_fn``).

A reward function is any callable ``fn(prompt_text, response_text, answer) -> float | Reward``.
``Task.reward`` calls it under a guard: an exception or a non-finite score gives that sample
``Reward(0.0, {"error": 1.0})`` and increments the task's ``num_reward_errors``; the run decides
whether that many failures stop it (``task.max_reward_error_fraction``, ``moerl.run.reward_errors``).

Where the module is found: the import path, then the folders of ``task.import_dirs`` (the config
file's folder and the folder the run started from, added by ``moerl.config.with_import_dirs``), which
``load_reward_fn`` puts on ``sys.path`` in whichever process builds the task (Ray workers included).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from moerl.tasks.base import ScoreFn

REWARD_ARGS = ("prompt_text", "response_text", "answer")
"""The arguments ``Task.reward`` passes a reward function, positionally and in this order."""


def add_import_dirs(dirs: Sequence[str]) -> None:
    """Append the existing folders of ``dirs`` to ``sys.path`` (after what is there: an installed package
    of the same name wins), once each."""
    for folder in dirs:
        if Path(folder).is_dir() and folder not in sys.path:
            sys.path.append(folder)


def load_reward_fn(spec: str, what: str = "reward_fn", dirs: Sequence[str] = ()) -> ScoreFn:
    """Import ``"package.module:function"`` (dots after the colon reach attributes, ``mod:Cls.fn``).
    ``what`` names the config field in error messages (also used for ``env.name``); ``dirs``: folders
    searched after the import path (``add_import_dirs``; ``task.import_dirs``).

    Raises:
        ValueError: ``spec`` is not of the form ``module:attribute``, or the target is not callable.
        ImportError: the module cannot be imported (the message names it).
        AttributeError: the module has no such attribute (the message names both).
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what}={spec!r} must look like 'package.module:function'")
    add_import_dirs(dirs)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        where = f" (looked on the import path and in {', '.join(dirs)})" if dirs else ""
        raise ImportError(f"{what}={spec!r}: cannot import module '{module_name}': {e}{where}") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what}={spec!r}: '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what}={spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def check_reward_signature(fn: Callable, spec: str, what: str = "task.reward_fn") -> None:
    """Check that ``fn`` accepts the three positional arguments ``Task.reward`` calls it with
    (``REWARD_ARGS``), so that a wrong function fails at load and not on every sample. A callable
    without an introspectable signature (some builtins) passes: there is nothing to check.

    Raises:
        ValueError: ``fn``'s signature cannot bind three positional arguments (the message names
            ``what``, ``spec`` and why the binding failed).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without __text_signature__
        return
    try:
        signature.bind(*REWARD_ARGS)
    except TypeError as e:
        raise ValueError(
            f"{what}={spec!r} cannot be called as fn({', '.join(REWARD_ARGS)}), the way moerl calls a "
            f"reward function: its signature {signature} gives '{e}'"
        ) from None


def load_score_fn(spec: str, what: str = "task.reward_fn", dirs: Sequence[str] = ()) -> ScoreFn:
    """``load_reward_fn`` plus ``check_reward_signature``: the reward function of ``task.reward_fn``.

    Raises:
        ValueError, ImportError, AttributeError: as ``load_reward_fn``, or a signature that cannot take
            ``(prompt_text, response_text, answer)``.
    """
    fn = load_reward_fn(spec, what=what, dirs=dirs)
    check_reward_signature(fn, spec, what)
    return fn
