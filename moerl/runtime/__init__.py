"""Runtime: task queue, experience buffer, weight store, checkpoints, and the parts of a run built on them
(trainer, rollout workers, the ``Rollouts`` of each mode; the run itself is ``moerl.train``).

Building blocks (each a plain, thread-safe Python class that a Ray actor can wrap):

- ``TaskQueue``: prompts -> tasks leased to workers with a ttl, heartbeat, and fencing tokens.
- ``ExperienceBuffer``: bounded, staleness-admitted, fenced hand-off of groups to the trainer.
- ``WeightStore``: versioned safetensors snapshots at an fsspec URL, manifest written last.
- ``save_checkpoint`` / ``load_checkpoint`` / ``latest_checkpoint``: atomic full-run checkpoints.

Exactly-once protocol (how the pieces are wired)::

    queue = TaskQueue(task.train_prompts(seed), num_samples=n, tokenize=tok.encode)
    buffer = ExperienceBuffer(cap, max_staleness=s, stale_policy="requeue",
                              settle=queue.settle, requeue=queue.requeue)
    # worker:  for lease in queue.lease(worker_id, ttl_s): generate while heartbeating
    #          (queue.heartbeat(worker_id)); buffer.put(Group.from_lease(lease, samples, secs))
    #          -- put settles the task in the queue (token check + ack in one step); no separate ack.
    #          On a drain notice: queue.release(lease) for groups that cannot finish.
    # trainer: groups = buffer.get(batch_groups); train; store.publish(v, weights); buffer.set_version(v)

A task's group is stored in the buffer at most once: ``settle`` accepts only the task's current lease
token, and an expired lease's token is never current again. Checkpoint the queue and buffer together
(``state_dict``) while workers are paused; on resume, leased tasks are leased again.
"""

from moerl.runtime.buffer import BufferClosed, BufferMetrics, ExperienceBuffer, PutResult, has_reward_variance
from moerl.runtime.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_step,
    restore_rng_state,
    save_checkpoint,
)
from moerl.runtime.queue import PromptLike, QueueStats, TaskQueue
from moerl.runtime.types import (
    FileEntry,
    Group,
    Lease,
    PartialResponse,
    RolloutTask,
    Sample,
    Settlement,
    TensorEntry,
    WeightManifest,
    WeightVersion,
)
from moerl.runtime.weights import ChecksumError, StoreNotWritableError, WeightStore

__all__ = [
    "BufferClosed",
    "BufferMetrics",
    "ChecksumError",
    "ExperienceBuffer",
    "FileEntry",
    "Group",
    "Lease",
    "PartialResponse",
    "PromptLike",
    "PutResult",
    "QueueStats",
    "RolloutTask",
    "Sample",
    "Settlement",
    "StoreNotWritableError",
    "TaskQueue",
    "TensorEntry",
    "WeightManifest",
    "WeightStore",
    "WeightVersion",
    "capture_rng_state",
    "has_reward_variance",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint_step",
    "restore_rng_state",
    "save_checkpoint",
]
