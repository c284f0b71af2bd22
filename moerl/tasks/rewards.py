"""User reward functions, selected by import path in the config (``task.reward_fn``).

A reward function is any callable ``fn(prompt_text, response_text, answer) -> float | Reward``. One that
names a parameter ``extra`` also gets ``extra=<dict>``: every column of the sample's dataset row that the
task does not consume itself (nested columns as they are, e.g. verl's ``reward_model``, ``extra_info``).
With ``task.reward_batched`` it is called once per group (training) or per held-out set (eval) with lists:
``fn(prompt_texts, response_texts, answers[, extra=extras]) -> list``, one value per sample. With
``task.reward_timeout_s`` a call that takes longer counts as a failed reward (``RewardTimeoutError``).
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
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REWARD_ARGS = ("prompt_text", "response_text", "answer")
"""The arguments ``Task.reward`` passes a reward function, positionally and in this order."""


def add_import_dirs(dirs: Sequence[str]) -> None:
    """Append the existing folders of ``dirs`` to ``sys.path`` (after what is there: an installed package
    of the same name wins), once each."""
    for folder in dirs:
        if Path(folder).is_dir() and folder not in sys.path:
            sys.path.append(folder)


def load_reward_fn(spec: str, what: str = "reward_fn", dirs: Sequence[str] = ()) -> Callable[..., Any]:
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
        kind = type(obj).__name__
        raise ValueError(f"{what}={spec!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a callable")
    return obj


def takes_extra(fn: Callable) -> bool:
    """Whether ``fn`` has a parameter named ``extra`` (then it is passed the row's other columns)."""
    try:
        return "extra" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without __text_signature__
        return False


def check_reward_signature(fn: Callable, spec: str, what: str = "task.reward_fn") -> None:
    """Check that ``fn`` accepts the three positional arguments ``Task.reward`` calls it with
    (``REWARD_ARGS``, plus ``extra=`` when it names that parameter), so that a wrong function fails at
    load and not on every sample. A callable without an introspectable signature (some builtins) passes:
    there is nothing to check.

    Raises:
        ValueError: ``fn``'s signature cannot bind three positional arguments (the message names
            ``what``, ``spec`` and why the binding failed).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without __text_signature__
        return
    extra = {"extra": {}} if "extra" in signature.parameters else {}
    try:
        signature.bind(*REWARD_ARGS, **extra)
    except TypeError as e:
        raise ValueError(
            f"{what}={spec!r} cannot be called as fn({', '.join(REWARD_ARGS)}), the way moerl calls a "
            f"reward function: its signature {signature} gives '{e}'"
        ) from None


class RewardTimeoutError(TimeoutError):
    """A reward function call took longer than ``task.reward_timeout_s``."""


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, abandoned after ``timeout_s`` seconds (None: no limit).

    The call runs on a daemon thread that is left running when it times out (Python cannot stop a
    thread): a verifier stuck forever holds one thread, not the run. Its exception is re-raised here.

    Raises:
        RewardTimeoutError: no result within ``timeout_s`` seconds.
        Exception: whatever ``fn`` raised.
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="moerl-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeoutError(f"reward function took more than task.reward_timeout_s={timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True, slots=True)
class RewardFunction:
    """A user reward function and how it is called (``Task`` calls it; see the module docstring).

    Attributes:
        fn: the callable.
        takes_extra: pass ``extra=`` (the row's other columns; ``takes_extra``).
        batched: call with lists (one call per group or held-out set), else once per sample.
        timeout_s: seconds one call may take (None: no limit); longer counts as a failure.
    """

    fn: Callable[..., Any]
    takes_extra: bool = False
    batched: bool = False
    timeout_s: float | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any], *, batched: bool = False, timeout_s: float | None = None):
        """``fn`` as a ``RewardFunction`` (one already is: returned as it is)."""
        if isinstance(fn, RewardFunction):
            return fn
        return cls(fn, takes_extra=takes_extra(fn), batched=batched, timeout_s=timeout_s)

    def call_one(self, prompt_text: str, response_text: str, answer: str, extra: dict | None) -> Any:
        """One per-sample call, ``fn(prompt_text, response_text, answer[, extra=extra])``."""
        kwargs = {"extra": dict(extra or {})} if self.takes_extra else {}
        return call_with_timeout(self.fn, self.timeout_s, prompt_text, response_text, answer, **kwargs)

    def call_batch(
        self, prompts: list[str], responses: list[str], answers: list[str], extras: list[dict | None]
    ) -> list[Any]:
        """One batched call with lists of equal length B; returns B values.

        Raises:
            TypeError: the function did not return a list (or tuple) of B values.
            RewardTimeoutError, Exception: as ``call_with_timeout``.
        """
        kwargs = {"extra": [dict(e or {}) for e in extras]} if self.takes_extra else {}
        values = call_with_timeout(self.fn, self.timeout_s, prompts, responses, answers, **kwargs)
        if not isinstance(values, (list, tuple)) or len(values) != len(prompts):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise TypeError(
                f"task.reward_batched: the reward function returned {got} for {len(prompts)} samples; "
                "expected a list with one float or Reward per sample"
            )
        return list(values)


def load_score_fn(
    spec: str,
    what: str = "task.reward_fn",
    dirs: Sequence[str] = (),
    *,
    batched: bool = False,
    timeout_s: float | None = None,
) -> RewardFunction:
    """``load_reward_fn`` plus ``check_reward_signature``: the reward function of ``task.reward_fn``, with
    how it is called (``task.reward_batched``, ``task.reward_timeout_s``).

    Raises:
        ValueError, ImportError, AttributeError: as ``load_reward_fn``, or a signature that cannot take
            ``(prompt_text, response_text, answer)``.
    """
    fn = load_reward_fn(spec, what=what, dirs=dirs)
    check_reward_signature(fn, spec, what)
    return RewardFunction.of(fn, batched=batched, timeout_s=timeout_s)
