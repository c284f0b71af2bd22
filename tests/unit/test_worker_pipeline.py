"""Async-mode plumbing without Ray: lease-ahead, deliveries off the critical path, the rollout gate.

The worker talks to a real queue and buffer through wrappers that behave like the Ray proxies: their
``*_async`` calls return a ``Pending`` that the test completes when it chooses.
"""

import pytest
import torch
from _tiny import tiny_model

from moerl.config import RolloutConfig, load_config
from moerl.rollout import Engine
from moerl.runtime.buffer import BufferClosed, ExperienceBuffer, PutResult
from moerl.runtime.queue import TaskQueue
from moerl.runtime.ray.exchange import ExchangeActor, rollout_allowance
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Prompt, Reward, load_tokenizer

TOK = load_tokenizer(None)


class Task:
    def reward(self, prompt_text, response_text, answer):
        return Reward(1.0, {})


class Deferred:
    """A ``Pending`` that runs its call when the test releases it (like an actor call in flight)."""

    def __init__(self, call):
        self.call, self.is_released, self.value, self.error = call, False, None, None

    def release(self):
        self.is_released = True
        try:
            self.value = self.call()
        except Exception as e:  # noqa: BLE001 - re-raised by result(), as ray.get does
            self.error = e

    def done(self):
        return self.is_released

    def result(self):
        if not self.is_released:
            self.release()  # a blocking wait: the call completes
        if self.error is not None:
            raise self.error
        return self.value


class AsyncBuffer:
    """``put_many_async`` over a local buffer; records each delivery (its size) and keeps it pending."""

    def __init__(self, buffer):
        self.buffer, self.sent = buffer, []

    def put_many_async(self, groups, timeout=None):
        def call():
            out = []
            for g in groups:
                try:
                    out.append(self.buffer.put(g, timeout=0.01))
                except TimeoutError:
                    return out + [None] * (len(groups) - len(out))
            return out

        self.sent.append(Deferred(call))
        self.sent[-1].size = len(groups)
        return self.sent[-1]


class CountingQueue:
    """A queue wrapper that counts lease calls."""

    def __init__(self, queue):
        self.queue, self.lease_calls = queue, []

    def lease(self, worker_id, ttl_s, max_tasks=1):
        self.lease_calls.append(max_tasks)
        return self.queue.lease(worker_id, ttl_s, max_tasks)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def _setup(*, lease_ahead=None, capacity=16, async_buffer=False, num_prompts=40, max_new_tokens=4):
    torch.manual_seed(0)
    model = tiny_model(TOK.vocab_size)
    prompts = (Prompt(id=f"p{i}", text=f"{i}+1=", answer="1") for i in range(num_prompts))
    queue = TaskQueue(prompts, num_samples=3, tokenize=TOK.encode)
    buffer = ExperienceBuffer(capacity, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    cfg = RolloutConfig(
        group_size=3,
        max_new_tokens=max_new_tokens,
        max_slots=6,
        kv_token_budget=6 * 64,
        lease_ahead_groups=lease_ahead,
    )
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    wq = CountingQueue(queue)
    wb = AsyncBuffer(buffer) if async_buffer else buffer
    worker = RolloutWorker("w0", engine, Task(), TOK.decode, wq, wb, cfg, stop_token_ids=(), run_seed=3)
    return queue, buffer, wq, wb, worker


def test_lease_ahead_fills_the_engine_queue_in_one_call():
    queue, buffer, wq, _, worker = _setup()  # 6 slots / 3 samples = 2 groups; lease-ahead default: 2 more
    assert (worker.max_groups_in_flight, worker.max_groups_held) == (2, 4)
    worker.step()
    assert wq.lease_calls == [4] and worker.num_in_flight == 4 and queue.stats().outstanding == 4
    assert worker.run(num_groups=10) == 10
    assert buffer.metrics().depth == 10 and queue.stats().acked == 10
    # refills only once the engine's queue ran dry (room >= 2), or to finish the budget
    assert all(n >= 2 for n in wq.lease_calls[:-1])
    assert len(wq.lease_calls) < 10


def test_without_lease_ahead_one_lease_per_free_group():
    queue, _, wq, _, worker = _setup(lease_ahead=0)
    assert worker.max_groups_held == 2
    assert worker.run(num_groups=6) == 6
    assert wq.lease_calls[0] == 2 and queue.stats().leased == 6


def test_delivery_is_not_waited_for_while_there_is_work():
    queue, buffer, _, wb, worker = _setup(async_buffer=True)  # 2 groups running, 2 queued in the engine
    while not wb.sent:  # the first two groups start together and finish in the same step
        worker.step()
    first = wb.sent[0]
    assert first.size == 2 and not first.done() and worker.num_undelivered == 2
    assert worker.num_in_flight == 2 and buffer.metrics().depth == 0 and queue.stats().outstanding == 4
    first.release()
    assert worker.step() == [PutResult.ADMITTED] * 2  # collected at the next step
    assert buffer.metrics().depth == 2 and worker.stats.groups_admitted == 2 and worker.num_undelivered == 0
    while len(wb.sent) < 2:
        worker.step()
    assert not wb.sent[1].done() and worker.num_in_flight == 2  # leased 2 more, decoding meanwhile
    progress = sorted(g.max_tokens_left for g in worker.in_flight())
    assert progress[:2] == [0, 0] and min(progress[2:]) > 0  # 2 finished, undelivered; 2 generating


def test_nothing_to_do_waits_for_the_delivery():
    queue, buffer, _, wb, worker = _setup(lease_ahead=0, async_buffer=True)
    while not wb.sent:
        worker.step()
    # both groups finished together: no room to lease (2 undelivered), nothing to decode: it waited
    assert wb.sent[0].done() and buffer.metrics().depth == 2 and worker.num_undelivered == 0


def test_full_buffer_sends_groups_back_and_stop_releases_them():
    queue, buffer, _, wb, worker = _setup(lease_ahead=0, capacity=1, async_buffer=True)
    while not wb.sent:  # both finish together; no room to lease: it waits for the delivery
        worker.step()
    assert worker.stats.groups_admitted == 1 and buffer.metrics().depth == 1  # one fitted
    assert worker.num_undelivered == 1 and len(wb.sent) == 2 and not wb.sent[1].done()  # resent
    worker.request_stop()
    assert worker.release_all() == 1  # waits for the resend (refused again), then releases
    stats = queue.stats()
    assert (stats.acked, stats.released, stats.outstanding) == (1, 1, 0)
    assert worker.num_undelivered == 0 and buffer.metrics().depth == 1


def test_release_all_after_the_buffer_closed_hands_every_group_back():
    queue, buffer, _, wb, worker = _setup(async_buffer=True)
    while not wb.sent:
        worker.step()
    buffer.close()  # the outstanding delivery (2 groups) will raise BufferClosed; 2 more are generating
    assert worker.release_all() == 4
    assert queue.stats().released == 4 and queue.stats().outstanding == 0
    with pytest.raises(BufferClosed):
        buffer.put(None)


def test_settle_deliveries_leaves_no_group_half_delivered():
    queue, buffer, _, wb, worker = _setup(async_buffer=True)
    while not wb.sent:
        worker.step()
    assert not wb.sent[0].done()
    assert worker.settle_deliveries() == [PutResult.ADMITTED] * 2
    assert worker.num_undelivered == 0 and buffer.metrics().depth == 2 and queue.stats().acked == 2


def test_rollout_allowance_counts_every_group_ahead_of_a_new_one():
    # B = 32 groups per version, max_staleness 1: (1 + 1 - lag) x 32 minus the groups ahead
    common = {"max_staleness": 1, "per_version": 32}
    assert rollout_allowance(**common, lag=0, leased=16, buffered=10, taken=32) == 6
    assert rollout_allowance(**common, lag=0, leased=16, buffered=40, taken=32) == 0
    assert rollout_allowance(**common, lag=0, leased=0, buffered=0, taken=0) == 64
    assert rollout_allowance(**common, lag=1, leased=0, buffered=20, taken=0) == 12  # old weights: 1 batch
    assert rollout_allowance(**common, lag=2, leased=0, buffered=0, taken=0) == 0


def test_exchange_gates_leases_by_staleness_window_and_worker_version():
    cfg = load_config(
        None, ["trainer.batch_groups=2", "runtime.max_staleness=1", "rollout.group_size=2", "task.num_eval=4"]
    )
    ex = ExchangeActor(cfg, None, version=0)
    leases = ex.lease("w", 60.0, 10)
    assert len(leases) == 4 and ex.lease("w", 60.0, 10) == []  # (1 + 1) x 2 groups
    ex.release(leases[0])  # back to pending: room for one
    assert len(ex.lease("w", 60.0, 10)) == 1
    for lease in leases[1:]:
        ex.release(lease)
    assert ex.queue_stats().outstanding == 1
    ex.set_version(0)  # a repeat of the current version changes nothing
    ex.set_version(1)
    # a worker still at version 0 lags one version: (1 + 1 - 1) x 2 - 1 outstanding = 1
    assert len(ex.lease("w", 60.0, 10, policy_version=0)) == 1
    assert len(ex.lease("w", 60.0, 10, policy_version=1)) == 2  # up to date: 2 x 2 - 2 outstanding
    with pytest.raises(ValueError, match="current version"):
        ex.set_version(0)


class GatedQueue(CountingQueue):
    """Leases at most ``allowed`` more tasks in all (a closed staleness gate answers ``[]``)."""

    def __init__(self, queue, allowed):
        super().__init__(queue)
        self.allowed = allowed

    def lease(self, worker_id, ttl_s, max_tasks=1):
        self.lease_calls.append(max_tasks)
        leases = self.queue.lease(worker_id, ttl_s, min(max_tasks, self.allowed)) if self.allowed else []
        self.allowed -= len(leases)
        return leases


def test_busy_worker_asks_a_closed_gate_again_only_after_new_weights_or_the_retry_time():
    queue, _, _, _, worker = _setup(lease_ahead=2, max_new_tokens=16)  # 2 groups decode, room for 2 more
    gate = worker.queue = GatedQueue(queue, allowed=2)
    worker.lease_retry_s = 60.0
    worker.step()
    worker.step()  # room for 2 more: asks, the gate is closed
    assert gate.lease_calls == [4, 2] and worker.num_in_flight == 2
    for _ in range(2):
        worker.step()  # still decoding, same weights: no round trip
    assert len(gate.lease_calls) == 2
    gate.allowed = 2
    worker.engine.update_weights(dict(worker.engine.model.named_parameters()), version=1)
    worker.step()  # new weights: asks at once and gets 2
    assert len(gate.lease_calls) == 3 and worker.num_in_flight == 4
    worker.lease_retry_s = 0.0  # the retry time has passed: asks at every step while there is room
    while worker.num_in_flight == 4:
        worker.step()
    calls = len(gate.lease_calls)
    worker.step()
    assert len(gate.lease_calls) == calls + 1


def test_idle_worker_asks_at_every_step():
    queue, _, _, _, worker = _setup()
    gate = worker.queue = GatedQueue(queue, allowed=0)
    worker.lease_retry_s = 60.0
    for _ in range(3):
        worker.step()
    assert len(gate.lease_calls) == 3 and worker.num_in_flight == 0
