"""Errors that the ``moerl`` command turns into one line (kept free of heavy imports: the CLI loads it
before any subcommand runs)."""

import errno


class StorageError(OSError):
    """An upload or download of run storage failed after its retries (``moerl.rundir.storage``); the
    message is one line naming the file."""


class WeightWriteError(StorageError):
    """A background write of a weight version to the weight store failed (``moerl.weights.durable``); the
    message is one line naming the version, the store and the cause. A full disk keeps its ``errno``
    (``DiskFullError.ERRNOS``) and file name, so a run stops as on any full disk."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # the line, also once errno and filename are set


class DiskFullError(OSError):
    """A run stopped because a write found no space left (``ENOSPC``) or the disk quota spent
    (``EDQUOT``); what was committed before it (checkpoints, weight versions) stays whole (atomic writes).

    Args:
        error: the write's own ``OSError`` (its ``errno``, ``strerror`` and ``filename`` are kept).
        folder: the run folder, or None when it was removed (stopped before its first step).
        resumable: True when ``folder`` holds a checkpoint that ``moerl train --resume`` continues from.
    """

    ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))
    """The ``errno`` values of a full disk: ``ENOSPC``, and ``EDQUOT`` where the platform has it."""

    def __init__(self, error: OSError, folder, resumable: bool) -> None:
        super().__init__(error.errno, error.strerror or str(error), error.filename)
        self.folder = folder
        self.resumable = resumable


class RunFolderInUseError(RuntimeError):
    """Another process holds a run folder's lock (``moerl.rundir.folder.RunFolderLock``): a second run or
    resume of it would rewind or overwrite what the live one writes. The message is one line naming the
    folder and the holder's pid."""


class RayStartError(RuntimeError):
    """A local Ray instance did not start: its raylet missed Ray's fixed 30 s registration wait in every
    attempt (``moerl.runtime.ray.local.retry_ray_start``; Ray's own error is the cause). The message is one
    line naming the start and the attempts."""


class WeightVersionRefused(RuntimeError):
    """Sync mode's rollout worker refused the trainer's newest weight version (its tensors are not the
    engine's parameter set, ``moerl.weights.sources.CheckedWeights``): generating on at an older version
    would not be on-policy, so the run stops. The message is one line naming the version."""


class EvalVersionRefused(RuntimeError):
    """Every rollout worker asked to evaluate a policy version had refused that version (its tensors did
    not check out, ``weights/refused_total``): the held-out eval of that step is skipped, the run goes on."""


class RewardFunctionError(RuntimeError):
    """The reward function failed (raised, or returned something that is not a finite number) on every
    sample of a run's first step, or on more than ``task.max_reward_error_fraction`` of the samples over
    ``task.reward_error_window`` steps (``moerl.run.reward_errors``). The message is one line; ``moerl
    train`` exits with ``EXIT_REWARD_FAILED``.

    Args:
        message: the line, naming the function, the failures counted and the first failure.
        folder: the run folder when it outlives the stop (a later step: resumable from its checkpoints once
            the function is fixed); None when the stop came before step 1 and the folder was removed.
    """

    def __init__(self, message: str, folder=None) -> None:
        super().__init__(message)
        self.folder = folder


EXIT_CONFIG = 2
"""``moerl`` exit status of a config error or bad input found before training (one line, nothing written)."""
EXIT_REWARD_FAILED = 3
"""``moerl train`` exit status of a run stopped by its failing reward function (``RewardFunctionError``)."""


class ExchangeLostError(RuntimeError):
    """The exchange actor (task queue + experience buffer, the run's central state) died with its node;
    the run stops: no step was half-trained into the run folder, the newest checkpoint stays whole.

    Args:
        message: one line saying what was lost (the actor's node and Ray's first line).
        folder: the run folder, or None while unknown (``RayRollouts`` raises it; ``moerl.train`` fills it).
        resumable: True when ``folder`` holds a checkpoint that ``moerl train --resume`` continues from.
    """

    def __init__(self, message: str, folder=None, resumable: bool = False) -> None:
        super().__init__(message)
        self.folder = folder
        self.resumable = resumable

    def line(self) -> str:
        """The one line ``moerl train`` prints: what was lost, and whether and how the run continues."""
        if self.resumable:
            return f"moerl: {self}; continue with: moerl train --resume {self.folder}"
        if self.folder is not None:
            return f"moerl: {self} before the first checkpoint: {self.folder} holds the metrics so far but cannot be resumed"
        return f"moerl: {self}"
