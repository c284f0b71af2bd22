"""TaskQueue: leasing order, fencing tokens, heartbeat, expiry, release, settle, resume."""

import dataclasses
import json
from collections import namedtuple

import pytest

from moerl.runtime import PartialResponse, RolloutTask, Settlement, TaskQueue


def ack(q, lease) -> bool:
    """What the buffer's ``put`` does for a delivered group: settle the lease as admitted."""
    return q.settle(lease.task_id, lease.token, Settlement.ADMITTED)


Prompt = namedtuple("Prompt", "id text answer")


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def prompts(n):
    return [Prompt(f"p{i}", f"q{i}", str(i)) for i in range(n)]


def make_queue(n=5, clock=None, **kw):
    return TaskQueue(
        prompts(n), num_samples=4, tokenize=lambda s: [ord(c) for c in s], clock=clock or FakeClock(), **kw
    )


def test_lease_builds_tasks_in_order_with_increasing_tokens():
    q = make_queue(clock=FakeClock(100.0))
    a, b = q.lease("w1", ttl_s=10.0, max_tasks=2)
    (c,) = q.lease("w2", ttl_s=5.0)
    assert [x.task_id for x in (a, b, c)] == ["0:p0", "1:p1", "2:p2"]
    assert [x.token for x in (a, b, c)] == [1, 2, 3]
    assert a.task.prompt_ids == (ord("q"), ord("0")) and a.task.answer == "0" and a.task.num_samples == 4
    assert a.task.attempt == 1 and a.worker_id == "w1"
    assert a.expires_at == 110.0 and c.expires_at == 105.0
    s = q.stats()
    assert (s.leased, s.outstanding, s.pending, s.cursor) == (3, 3, 0, 3)


def test_ack_only_with_current_token():
    q = make_queue()
    (lease,) = q.lease("w", 10.0)
    assert q.validate(lease)
    assert ack(q, lease) is True
    assert ack(q, lease) is False  # already done
    assert not q.validate(lease)
    s = q.stats()
    assert (s.acked, s.refused, s.outstanding) == (1, 1, 0)


def test_ack_after_expiry_refused_and_task_released_with_higher_token():
    clock = FakeClock(0.0)
    q = make_queue(n=3, clock=clock)
    (old,) = q.lease("slow", ttl_s=10.0)
    clock.now = 10.0  # expiry is inclusive: now >= expires_at
    assert ack(q, old) is False
    (new,) = q.lease("fast", ttl_s=10.0)
    assert new.task_id == old.task_id  # an expired task is leased before new prompts
    assert new.token > old.token and new.task.attempt == 2
    assert ack(q, old) is False  # the slow worker's late ack stays refused
    assert ack(q, new) is True
    s = q.stats()
    assert (s.expired, s.requeued, s.acked, s.refused) == (1, 1, 1, 2)


def test_heartbeat_renews_lease_and_worker():
    clock = FakeClock(0.0)
    q = make_queue(clock=clock)
    a, b = q.lease("w", ttl_s=10.0, max_tasks=2)
    clock.now = 6.0
    (renewed,) = q.heartbeat(a)
    assert renewed.token == a.token and renewed.expires_at == 16.0
    clock.now = 12.0  # b expired at 10, a lives until 16
    assert q.validate(a) and not q.validate(b)
    assert [x.token for x in q.heartbeat("w", ttl_s=20.0)] == [a.token]
    clock.now = 31.0
    assert q.validate(a)
    clock.now = 32.0
    assert q.heartbeat(a) == [] and q.heartbeat("w") == []


def test_release_is_idempotent_and_puts_task_first():
    q = make_queue()
    a, b = q.lease("w", 10.0, max_tasks=2)
    assert q.release(b) is True
    assert q.release(b) is False
    assert ack(q, b) is False
    (again,) = q.lease("w2", 10.0)
    assert again.task_id == b.task_id and again.token == 3
    assert q.release(b) is False  # the old lease cannot release the new holder's task
    assert q.validate(again)
    s = q.stats()
    assert (s.released, s.requeued, s.outstanding) == (1, 1, 2)


def test_max_materialized_bounds_tasks_held():
    q = make_queue(n=10, max_materialized=3)
    leases = q.lease("w", 10.0, max_tasks=5)
    assert len(leases) == 3 and q.stats().cursor == 3
    assert q.lease("w", 10.0) == []
    ack(q, leases[0])
    assert [x.task_id for x in q.lease("w", 10.0, max_tasks=5)] == ["3:p3"]


def test_exhausted_source():
    q = make_queue(n=2)
    leases = q.lease("w", 10.0, max_tasks=5)
    assert len(leases) == 2 and not q.stats().is_exhausted
    for lease in leases:
        ack(q, lease)
    assert q.lease("w", 10.0) == [] and q.stats().is_exhausted


def test_settle_outcomes():
    q = make_queue(n=4)
    a, b, c, d = q.lease("w", 10.0, max_tasks=4)
    assert q.settle(a.task_id, a.token, Settlement.ADMITTED)
    assert q.settle(b.task_id, b.token, Settlement.FILTERED)
    assert q.settle(c.task_id, c.token, Settlement.DROPPED_STALE)
    assert q.settle(d.task_id, d.token, Settlement.REQUEUED_STALE)
    assert not q.settle(d.task_id, d.token, Settlement.ADMITTED)
    s = q.stats()
    assert s.acked == s.filtered == s.dropped_stale == s.requeued_stale == s.requeued == s.refused == 1
    (d2,) = q.lease("w", 10.0)
    assert d2.task_id == d.task_id and d2.task.attempt == 2


def test_requeue_done_task_and_refuse_duplicate():
    q = make_queue(n=2)
    (a,) = q.lease("w", 10.0)
    ack(q, a)
    q.requeue(a.task)
    (again,) = q.lease("w", 10.0)
    assert again.task_id == a.task_id and again.token > a.token and again.task.attempt == 2
    with pytest.raises(ValueError, match="still pending or leased"):
        q.requeue(again.task)


def test_state_dict_round_trip_returns_leased_tasks_to_pending():
    clock = FakeClock(0.0)
    q = make_queue(n=6, clock=clock)
    a, b, c = q.lease("w", 10.0, max_tasks=3)
    ack(q, a)
    q.release(c)
    state = json.loads(json.dumps(q.state_dict()))  # must be JSON-serialisable
    fresh = make_queue(n=6, clock=clock)
    fresh.load_state_dict(state)
    s = fresh.stats()
    assert (s.cursor, s.pending, s.outstanding, s.acked, s.released) == (3, 2, 0, 1, 1)
    assert s.requeued == 2  # the release + the lease open at checkpoint time
    assert not fresh.validate(b)  # tokens from before the resume are not current
    leases = fresh.lease("w", 10.0, max_tasks=3)
    assert [x.task_id for x in leases] == [c.task_id, b.task_id, "3:p3"]
    assert min(x.token for x in leases) > c.token  # fencing tokens keep increasing across a resume
    assert leases[1].task.attempt == 2


def test_load_state_dict_errors():
    q = make_queue(n=6)
    q.lease("w", 10.0, max_tasks=4)
    state = q.state_dict()
    with pytest.raises(RuntimeError, match="fresh queue"):
        q.load_state_dict(state)
    with pytest.raises(ValueError, match="source ended after 2 prompts"):
        make_queue(n=2).load_state_dict(state)
    with pytest.raises(ValueError, match="unknown format"):
        make_queue().load_state_dict({"format": "x"})


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_samples=0"):
        TaskQueue([], num_samples=0, tokenize=list)
    with pytest.raises(ValueError, match="max_materialized=0"):
        TaskQueue([], num_samples=1, tokenize=list, max_materialized=0)
    q = make_queue()
    with pytest.raises(ValueError, match="ttl_s=0"):
        q.lease("w", 0)
    with pytest.raises(ValueError, match="max_tasks=0"):
        q.lease("w", 1.0, max_tasks=0)
    with pytest.raises(ValueError, match="num_samples=0"):
        RolloutTask("t", (1,), "x", "y", num_samples=0)


def test_release_with_partial_prefix_is_handed_to_next_lease_and_survives_resume():
    q = make_queue(n=2)
    (lease,) = q.lease("draining", 10.0)
    prefix = PartialResponse(
        sample_index=3, response_ids=[7, 8], response_logprobs=[-0.5, -1.5], policy_versions=[2, 2]
    )
    assert q.release(lease, partial=[prefix])
    restored = make_queue(n=2)
    restored.load_state_dict(json.loads(json.dumps(q.state_dict())))
    for queue in (q, restored):
        (again,) = queue.lease("next", 10.0)
        assert again.task_id == lease.task_id and again.task.partial == (prefix,)
    with pytest.raises(ValueError, match="partial sample_index=4 not in"):
        RolloutTask("t", (1,), "x", "y", num_samples=4, partial=[dataclasses.replace(prefix, sample_index=4)])
    with pytest.raises(ValueError, match="have lengths 1, 2, 2"):
        PartialResponse(
            sample_index=0, response_ids=[1], response_logprobs=[0.0, 0.0], policy_versions=[0, 0]
        )
