"""The trainer as the run (``moerl.train``) sees it: one declared interface, two implementations.

``LocalTrainer`` (``local.py``) trains the policy in this process; ``TrainerGroup``
(``distributed/group.py``) drives ``trainer.num_ranks`` torch.distributed ranks (FSDP2 x EP) as one
trainer, as local processes (sync mode) or Ray actors (async mode). ``make_trainer``
(``distributed/factory.py``) picks one from the config; nothing outside ``moerl.trainer`` asks which.
The weights leave a trainer through ``publish`` (the durable store) or a weight transport
(``moerl.weights.transport``), which asks the trainer for its tensors or buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from moerl.ep.traffic import DirectionTraffic
    from moerl.records import Group, WeightVersion
    from moerl.trainer.batch import TrainBatch
    from moerl.trainer.local import TrainStats
    from moerl.weights.store import WeightStore


@runtime_checkable
class Trainer(Protocol):
    """A policy under training: batches in, optimizer steps, versioned weights out.

    Attributes:
        step: optimizer steps taken (int, 0 before the first).
        version: policy version of the current weights (``step + version_offset``; never goes back).
        version_offset: policy version minus step, raised when a restarted trainer resumes an older
            checkpoint (``moerl.run.recovery``).
        num_skipped: steps skipped for a non-finite loss.
        num_ranks: training processes (1 for ``LocalTrainer``).
        pids: their process ids, rank order.
        last_ep_traffic: EP bytes of the last ``train_step`` summed over ranks, by direction and link
            class (``moerl.ep.traffic``); None without expert parallelism across ranks.
    """

    step: int
    version_offset: int
    num_skipped: int
    num_ranks: int
    last_ep_traffic: DirectionTraffic | None

    @property
    def version(self) -> int: ...

    @property
    def pids(self) -> list[int]: ...

    def build_batch(self, groups: Sequence[Group], pad_id: int) -> TrainBatch:
        """The step's groups as one padded ``TrainBatch`` (advantages computed over whole groups)."""
        ...

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One optimizer step (or ``ppo_epochs x mini_batches`` of them) on ``batch``.

        Raises:
            NonFiniteLossError: ``trainer.max_nan_steps`` non-finite steps in a row.
            TrainerRankError: a rank of a group died or hung (``moerl.trainer.distributed.rank``).
        """
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full weights of the current version by ``state_dict`` name (read-only views)."""
        ...

    def publish(self, store: WeightStore) -> WeightVersion | None:
        """Write the current version to ``store`` (atomic, manifest last); None: written in the background."""
        ...

    def refresh_model(self) -> None:
        """Bring the driver's copy of the policy (used for evaluation) to the current version."""
        ...

    def checkpoint(self, run_dir: str | Path, extra: dict, *, keep: int = 2) -> Path:
        """Save the full run state after this step as ``checkpoints/step_<step>`` (atomic), with the
        ``extra`` parts (queue, buffer, controller); returns the step folder."""
        ...

    def export_policy(self, folder: str | Path, extra: Callable[[Path], None] | None = None) -> Path:
        """Write the current policy as a Hugging Face folder, replacing ``folder`` atomically;
        ``extra(tmp)`` adds files (the tokenizer) before the rename."""
        ...

    def close(self) -> None:
        """Stop the trainer's processes (idempotent; nothing to stop for ``LocalTrainer``)."""
        ...
