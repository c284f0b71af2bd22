"""Runtime: the rollout data plane -- task queue, experience buffer, rollout workers, the fleet, notices,
and the ``Rollouts`` of each mode with their Ray glue (the run itself is ``moerl.train``; weights move
through ``moerl.weights``, the trainer is ``moerl.trainer``, the run folder ``moerl.run``).

Building blocks (each a plain, thread-safe Python class that a Ray actor can wrap):

- ``TaskQueue``: prompts -> tasks leased to workers with a ttl, heartbeat, and fencing tokens.
- ``ExperienceBuffer``: bounded, staleness-admitted, fenced hand-off of groups to the trainer.

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

from moerl.records import (
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
from moerl.runtime.buffer import BufferClosed, BufferMetrics, ExperienceBuffer, PutResult, has_reward_variance
from moerl.runtime.queue import PromptLike, QueueStats, TaskQueue

__all__ = [
    "BufferClosed",
    "BufferMetrics",
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
    "TaskQueue",
    "TensorEntry",
    "WeightManifest",
    "WeightVersion",
    "has_reward_variance",
]
