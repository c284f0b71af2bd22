"""ExperienceBuffer: FIFO, backpressure, staleness admission (drop / requeue), filters, fencing, state."""

import threading
from collections import namedtuple

import pytest
import torch

from moerl.runtime import (
    BufferClosed,
    ExperienceBuffer,
    Group,
    Lease,
    PutResult,
    RolloutTask,
    Sample,
    Settlement,
    TaskQueue,
    has_reward_variance,
)
from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint

Prompt = namedtuple("Prompt", "id text answer")


def sample(version=0, reward=1.0, routed=None):
    return Sample(
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        response_logprobs=[-0.5, -0.25, -1.0],
        loss_mask=[1, 1, 1],
        finish_reason="stop",
        policy_versions=[version, version, version + 1],
        reward=reward,
        reward_info={"format": 1.0},
        routed_experts=routed,
    )


def group(task_id="t", token=1, version=0, rewards=(1.0, 0.0)):
    lease = Lease(RolloutTask(task_id, (5, 6), "q", "a", len(rewards), attempt=1), "w", token, 0.0)
    return Group.from_lease(lease, [sample(version, r) for r in rewards], gen_seconds=0.5)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def wired(capacity=4, max_staleness=1, stale_policy="drop", filters=(), num_tasks=10):
    clock = FakeClock()
    queue = TaskQueue(
        [Prompt(f"p{i}", "q", "a") for i in range(num_tasks)],
        num_samples=2,
        tokenize=lambda s: [1],
        clock=clock,
    )
    buf = ExperienceBuffer(
        capacity,
        max_staleness=max_staleness,
        stale_policy=stale_policy,
        filters=filters,
        settle=queue.settle,
        requeue=queue.requeue,
    )
    return queue, buf, clock


def delivered(lease, version=0, rewards=(1.0, 0.0)):
    return Group.from_lease(lease, [sample(version, r) for r in rewards], gen_seconds=0.1)


def test_group_derived_fields_and_sample_validation():
    g = group(version=3)
    assert g.min_policy_version == 3 and g.num_tokens == 2 * (2 + 3) and g.rewards == (1.0, 0.0)
    assert g.task_id == "t" and g.lease_token == 1
    with pytest.raises(ValueError, match="loss_mask has length 1; expected R=2"):
        Sample(
            prompt_ids=[1],
            response_ids=[2, 3],
            response_logprobs=[0.0, 0.0],
            loss_mask=[1],
            finish_reason="stop",
            policy_versions=[0, 0],
            reward=0.0,
        )


def test_fifo_get_and_metrics():
    buf = ExperienceBuffer(4, max_staleness=2)
    for i in range(3):
        assert buf.put(group(f"t{i}")) is PutResult.ADMITTED
    assert buf.metrics().depth == 3
    assert [g.task_id for g in buf.get(2)] == ["t0", "t1"]
    m = buf.metrics()
    assert (m.depth, m.admitted, m.delivered) == (1, 3, 2)


def test_put_blocks_when_full_then_times_out():
    buf = ExperienceBuffer(2, max_staleness=0)
    buf.put(group("a"))
    buf.put(group("b"))
    with pytest.raises(TimeoutError, match="buffer full"):
        buf.put(group("c"), timeout=0.05)
    m = buf.metrics()
    assert (m.depth, m.put_timeouts, m.admitted) == (2, 1, 2)
    assert m.put_wait_s >= 0.05


def test_put_many_stops_at_the_first_timeout_and_offers_nothing_after_it():
    buf = ExperienceBuffer(2, max_staleness=0)
    results = buf.put_many([group("a"), group("b"), group("c"), group("d")], timeout=0.01)
    assert results == [PutResult.ADMITTED, PutResult.ADMITTED, None, None]
    m = buf.metrics()
    assert (m.depth, m.put_timeouts, m.admitted) == (2, 1, 2)  # "d" was never offered
    assert buf.put_many([], timeout=0.01) == []


def test_producer_flood_keeps_depth_bounded():
    buf = ExperienceBuffer(3, max_staleness=0)
    num_groups = 40
    max_depth = []

    def produce():
        for i in range(num_groups):
            buf.put(group(f"t{i}"), timeout=5.0)
            max_depth.append(buf.metrics().depth)

    producer = threading.Thread(target=produce)
    producer.start()
    got = []
    while len(got) < num_groups:
        got += [g.task_id for g in buf.get(1, timeout=5.0)]
        max_depth.append(buf.metrics().depth)
    producer.join()
    assert got == [f"t{i}" for i in range(num_groups)]
    assert max(max_depth) <= 3
    assert buf.metrics().put_wait_s > 0.0


def test_get_blocks_until_enough_then_times_out():
    buf = ExperienceBuffer(4, max_staleness=0)
    buf.put(group("a"))
    with pytest.raises(TimeoutError, match="1 of 2 groups"):
        buf.get(2, timeout=0.05)
    assert buf.metrics().depth == 1  # nothing taken on timeout
    timer = threading.Timer(0.05, lambda: buf.put(group("b")))
    timer.start()
    assert [g.task_id for g in buf.get(2, timeout=5.0)] == ["a", "b"]
    timer.join()


def test_close_wakes_blocked_get():
    buf = ExperienceBuffer(1, max_staleness=0)
    threading.Timer(0.05, buf.close).start()
    with pytest.raises(BufferClosed):
        buf.get(1, timeout=5.0)
    with pytest.raises(BufferClosed):
        buf.put(group())


def test_staleness_admission_at_put_drop():
    queue, buf, _ = wired(max_staleness=2, stale_policy="drop")
    buf.set_version(5)
    fresh, stale = queue.lease("w", 10.0, max_tasks=2)
    assert buf.put(delivered(fresh, version=3)) is PutResult.ADMITTED  # 3 >= 5 - 2
    assert buf.put(delivered(stale, version=2)) is PutResult.DROPPED_STALE  # 2 < 3
    assert buf.metrics().dropped_stale == 1
    s = queue.stats()
    assert (s.acked, s.dropped_stale, s.outstanding, s.pending) == (1, 1, 0, 0)


def test_staleness_admission_at_put_requeue():
    queue, buf, _ = wired(max_staleness=0, stale_policy="requeue")
    (lease,) = queue.lease("w", 10.0)
    assert buf.put(delivered(lease, version=0), trainer_version=1) is PutResult.REQUEUED_STALE
    assert buf.metrics().requeued_stale == 1
    (again,) = queue.lease("w", 10.0)
    assert again.task_id == lease.task_id and again.token > lease.token


def test_groups_aging_in_buffer_are_requeued_and_staleness_reported():
    queue, buf, _ = wired(capacity=4, max_staleness=2, stale_policy="requeue")
    leases = queue.lease("w", 10.0, max_tasks=3)
    for lease, version in zip(leases, (3, 4, 5), strict=True):
        assert buf.put(delivered(lease, version=version), trainer_version=5) is PutResult.ADMITTED
    buf.set_version(6)  # min admissible 4: the version-3 group ages out
    assert buf.metrics().depth == 2 and buf.metrics().requeued_stale == 1
    batch = buf.get(2)
    assert [g.min_policy_version for g in batch] == [4, 5]
    m = buf.metrics()
    assert (m.staleness_mean, m.staleness_max) == (1.5, 2)  # 6-4, 6-5
    (again,) = queue.lease("w", 10.0)
    assert again.task_id == leases[0].task_id and again.task.attempt == 2


def test_groups_aging_in_buffer_dropped():
    buf = ExperienceBuffer(4, max_staleness=1, stale_policy="drop")
    buf.put(group("old", version=0))
    buf.put(group("new", version=2))
    buf.set_version(2)
    assert [g.task_id for g in buf.get(1)] == ["new"]
    assert buf.metrics().dropped_stale == 1


def test_dynamic_sampling_filter():
    queue, buf, _ = wired(filters=[has_reward_variance])
    a, b = queue.lease("w", 10.0, max_tasks=2)
    assert buf.put(delivered(a, rewards=(1.0, 1.0))) is PutResult.FILTERED
    assert buf.put(delivered(b, rewards=(1.0, 0.0))) is PutResult.ADMITTED
    m = buf.metrics()
    assert (m.filtered, m.filtered_by, m.depth) == (1, {"has_reward_variance": 1}, 1)
    assert queue.stats().filtered == 1


def test_late_delivery_refused_by_fencing_token():
    queue, buf, clock = wired()
    (slow,) = queue.lease("slow", ttl_s=10.0)
    clock.now = 11.0
    (fast,) = queue.lease("fast", ttl_s=10.0)
    assert fast.task_id == slow.task_id
    assert buf.put(delivered(slow)) is PutResult.REFUSED_STALE_TOKEN
    assert buf.put(delivered(fast)) is PutResult.ADMITTED
    assert buf.put(delivered(fast)) is PutResult.REFUSED_STALE_TOKEN  # a duplicate delivery too
    m = buf.metrics()
    assert (m.refused_stale_token, m.admitted, m.depth) == (2, 1, 1)
    assert queue.settle(fast.task_id, fast.token, Settlement.ADMITTED) is False  # put already settled it


def test_state_round_trip_through_checkpoint(tmp_path):
    buf = ExperienceBuffer(4, max_staleness=3)
    routed = torch.arange(5 * 2 * 2).reshape(5, 2, 2)
    lease = Lease(RolloutTask("t0", (5, 6), "q", "a", 1, attempt=1), "w", 7, 0.0)
    buf.put(Group.from_lease(lease, [sample(1, 0.5, routed)], 0.25))
    buf.put(group("t1", version=2))
    buf.set_version(3)
    path = save_checkpoint(tmp_path, 1, {"buffer": buf.state_dict()})
    restored = ExperienceBuffer(4, max_staleness=3)
    restored.load_state_dict(load_checkpoint(path)["buffer"])
    assert restored.metrics() == buf.metrics()
    a, b = buf.get(2), restored.get(2)
    assert a == b  # dataclass equality, routed_experts excluded from it
    assert torch.equal(b[0].samples[0].routed_experts, routed)
    with pytest.raises(RuntimeError, match="empty buffer"):
        restored.put(group("x"))
        restored.load_state_dict(buf.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity=0"):
        ExperienceBuffer(0, max_staleness=0)
    with pytest.raises(ValueError, match="stale_policy='keep'"):
        ExperienceBuffer(1, max_staleness=0, stale_policy="keep")
    with pytest.raises(ValueError, match="needs a requeue callable"):
        ExperienceBuffer(1, max_staleness=0, stale_policy="requeue", settle=lambda *a: True)
    buf = ExperienceBuffer(2, max_staleness=0, initial_version=3)
    with pytest.raises(ValueError, match="batch_size=3"):
        buf.get(3)
    with pytest.raises(ValueError, match="2 < current version 3"):
        buf.set_version(2)
