"""Drain procedure on a scripted worker over a real TaskQueue; prefix resume on a real engine."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.records import PartialResponse, RolloutTask, Settlement
from moerl.rollout import Completion, Engine, Request, SamplingParams
from moerl.runtime.drain import Drainer, InFlightGroup, ResumePlan, group_progress
from moerl.runtime.notice import TerminationNotice
from moerl.runtime.queue import TaskQueue
from moerl.tasks import Prompt


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class ScriptedWorker:
    """Holds leases whose groups need ``tokens_left`` more decode steps; each step takes ``step_s``.

    Every sample of a group has generated as many tokens as steps the group has run.
    """

    def __init__(self, queue, clock, tokens_left, *, n=2, step_s=1.0):
        self.queue, self.clock, self.n, self.step_s = queue, clock, n, step_s
        self.jobs = {}
        for left in tokens_left:
            (lease,) = queue.lease("w0", ttl_s=1000.0)
            self.jobs[lease.task_id] = [lease, left, 0]
        self.is_leasing, self.steps, self.delivered = True, 0, []

    def stop_leasing(self):
        self.is_leasing = False

    def step(self):
        self.clock.t += self.step_s
        self.steps += 1
        done = []
        for task_id, job in list(self.jobs.items()):
            job[1] -= 1
            job[2] += 1
            if job[1] == 0:
                assert self.queue.settle(task_id, job[0].token, Settlement.ADMITTED)
                del self.jobs[task_id]
                done.append(task_id)
        self.delivered += done
        return done

    def in_flight(self):
        out = []
        for lease, left, made in self.jobs.values():
            prefixes = tuple(
                PartialResponse(i, [7] * made, [-0.5] * made, [3] * made) for i in range(self.n) if made
            )
            out.append(InFlightGroup(lease, prefixes, left))
        return out

    def abandon(self, task_id, partial):
        lease = self.jobs.pop(task_id)[0]
        return self.queue.release(lease, partial=partial)


def _queue(clock, num=8):
    prompts = (Prompt(id=f"p{i}", text=f"{i}+1=", answer=str(i + 1)) for i in range(num))
    return TaskQueue(prompts, num_samples=2, tokenize=lambda s: [ord(c) % 50 for c in s], clock=clock)


def test_generous_grace_finishes_everything():
    clock = Clock()
    queue = _queue(clock)
    worker = ScriptedWorker(queue, clock, [2, 4, 3])
    report = Drainer(90.0, clock=clock).drain(worker)
    assert not worker.is_leasing and worker.steps == 4
    assert (report.groups_delivered, report.groups_released, report.tokens_discarded) == (3, 0, 0)
    assert report.seconds == 4.0 and report.grace_s == 90.0
    stats = queue.stats()
    assert (stats.acked, stats.released, stats.outstanding) == (3, 0, 0)


def test_groups_that_cannot_finish_are_released_after_first_step():
    clock = Clock()
    queue = _queue(clock)
    worker = ScriptedWorker(queue, clock, [2, 4, 10])
    report = Drainer(5.0, clock=clock).drain(worker)
    # step 1 (t 0 -> 1) measures 1 s/step; at t = 1 the 10-token group projects 1 + 9 = 10 > 5: released
    # with 1 token per sample (2 tokens); the others finish at t = 2 and t = 4
    assert (report.groups_delivered, report.groups_released) == (2, 1)
    assert (report.tokens_discarded, report.tokens_kept, report.seconds) == (2, 0, 4.0)
    assert worker.delivered == ["0:p0", "1:p1"]
    (again,) = queue.lease("w1", ttl_s=10.0)
    assert again.task_id == "2:p2" and again.task.partial == () and again.task.attempt == 2
    assert queue.stats().released == 1


def test_keep_partial_hands_prefixes_to_next_lease():
    clock = Clock()
    queue = _queue(clock)
    worker = ScriptedWorker(queue, clock, [3, 3])
    report = Drainer(1.5, keep_partial=True, clock=clock).drain(worker)
    # t = 1 after one step: both project 1 + 2 = 3 > 1.5, released with 1 token per sample, kept
    assert (report.groups_delivered, report.groups_released, report.tokens_kept, report.tokens_discarded) == (
        0,
        2,
        4,
        0,
    )
    lease = queue.lease("w1", ttl_s=10.0)[0]
    assert [p.response_ids for p in lease.task.partial] == [(7,), (7,)]
    assert [p.policy_versions for p in lease.task.partial] == [(3,), (3,)]


def test_zero_grace_releases_without_stepping():
    clock = Clock()
    queue = _queue(clock)
    worker = ScriptedWorker(queue, clock, [1, 1])
    report = Drainer(0.0, clock=clock).drain(worker)
    assert worker.steps == 0 and report.groups_released == 2 and report.groups_delivered == 0


def test_expired_lease_release_is_counted_as_discarded():
    clock = Clock()
    queue = _queue(clock)
    worker = ScriptedWorker(queue, clock, [5])
    worker.step()  # one token per sample
    clock.t += 2000.0  # the lease expired meanwhile: release is refused, the tokens are lost
    report = Drainer(0.0, clock=clock).drain(worker)
    assert (report.groups_released, report.tokens_discarded) == (0, 2)
    assert queue.stats().expired == 1


def test_notice_deadline_shortens_grace():
    d = Drainer(90.0, margin_s=5.0)
    assert d.grace_for(None) == 90.0
    notice = TerminationNotice("http", "terminate", 0.0, deadline_epoch_s=1000.0)
    assert d.grace_for(TerminationNotice("http", "terminate", 0.0, time.time() + 30.0)) == pytest.approx(
        25.0, abs=0.5
    )
    assert d.grace_for(notice) == 0.0  # deadline long past
    with pytest.raises(ValueError, match="grace_s"):
        Drainer(-1.0)


def test_group_progress_from_finished_and_running():
    clock = Clock()
    (lease,) = _queue(clock).lease("w", 10.0)
    lease = dataclasses.replace(lease, task=dataclasses.replace(lease.task, num_samples=3))
    done = [
        Completion(
            request_id="r",
            sample_index=1,
            prompt_ids=[1],
            token_ids=[4, 5],
            logprobs=[-1.0, -2.0],
            finish_reason="stop",
            policy_versions=[0, 0],
        )
    ]

    class Seq:
        sample_index, token_ids, logprobs, policy_versions = 0, [9, 9, 9], [-0.1, -0.2], [0, 1]

    g = group_progress(lease, done, [Seq()], max_new_tokens=8)
    # the running sample has 2 host-synced tokens (logprobs are shorter); sample 2 is still waiting: 8 left
    assert [(p.sample_index, p.response_ids) for p in g.prefixes] == [(0, (9, 9)), (1, (4, 5))]
    assert g.num_tokens == 4 and g.max_tokens_left == 8


VOCAB = 61


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="qwen3_moe", max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits, so greedy continuations are stable
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m


def test_resume_plan_continues_prefix_like_uninterrupted_greedy(model):
    prompt = [5, 17, 3, 44, 8]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, n=2)
    (full0, full1) = Engine(model, max_slots=4, kv_token_budget=4 * 32).generate(
        [Request(request_id="g", prompt_ids=prompt, params=params)]
    )
    partial = (
        PartialResponse(0, full0.token_ids[:3], full0.logprobs[:3], [1, 1, 1]),
        PartialResponse(1, full1.token_ids, full1.logprobs, [1] * 8),
    )
    task = RolloutTask(
        task_id="t", prompt_ids=prompt, prompt_text="x", answer="y", num_samples=2, partial=partial
    )
    plan = ResumePlan(task, params, "g#2")
    assert [c.sample_index for c in plan.ready] == [1] and plan.ready[0].finish_reason == "length"
    assert plan.ready[0].token_ids == full1.token_ids
    (req,) = plan.requests
    assert (
        req.request_id == "g#2/0"
        and req.params.max_new_tokens == 5
        and req.prompt_ids == prompt + full0.token_ids[:3]
    )
    engine = Engine(model, max_slots=4, kv_token_budget=4 * 32, version=2)
    merged = plan.complete(engine.generate([req])[0])
    assert merged.sample_index == 0 and merged.prompt_ids == prompt and merged.request_id == "g#2"
    assert merged.token_ids == full0.token_ids
    assert merged.policy_versions == [1, 1, 1, 2, 2, 2, 2, 2]
    assert merged.logprobs[:3] == full0.logprobs[:3]
    assert merged.logprobs[3:] == pytest.approx(full0.logprobs[3:], abs=1e-4)
    with pytest.raises(KeyError):
        plan.complete(
            Completion(
                request_id="other",
                sample_index=0,
                prompt_ids=[],
                token_ids=[],
                logprobs=[],
                finish_reason="stop",
                policy_versions=[],
            )
        )


def test_resume_plan_stop_token_prefix_is_ready_and_too_long_prefix_rejected():
    params = SamplingParams(max_new_tokens=4, n=2, stop_token_ids=(0,), seed=11)
    task = RolloutTask(
        task_id="t",
        prompt_ids=[1],
        prompt_text="",
        answer="",
        num_samples=2,
        partial=(PartialResponse(0, [3, 0], [-1.0, -1.0], [0, 0]),),
    )
    plan = ResumePlan(task, params, "r")
    assert [(c.sample_index, c.finish_reason) for c in plan.ready] == [(0, "stop")]
    (req,) = plan.requests  # sample 1 had no prefix: generated from the prompt
    assert (
        req.prompt_ids == [1]
        and req.params.max_new_tokens == 4
        and req.params.n == 1
        and req.params.seed == 12
    )
    long = RolloutTask(
        task_id="t",
        prompt_ids=[1],
        prompt_text="",
        answer="",
        num_samples=2,
        partial=(PartialResponse(0, [3] * 5, [-1.0] * 5, [0] * 5),),
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        ResumePlan(long, params, "r")


def test_blocked_delivery_is_given_up_at_the_deadline():
    """A step stuck on a full buffer: request_stop() at the deadline makes it give the task up (None)."""
    import threading

    clock = Clock()
    queue = _queue(clock)

    class StuckWorker(ScriptedWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.stopped = threading.Event()

        def request_stop(self):
            self.stopped.set()

        def step(self):
            assert self.stopped.wait(10.0)  # blocked in put until the drain's deadline timer fires
            task_id, (lease, _, _) = next(iter(self.jobs.items()))
            del self.jobs[task_id]
            self.queue.release(lease)
            return [None]

    worker = StuckWorker(queue, clock, [1])
    report = Drainer(0.2).drain(worker)  # real clock: the timer fires after 0.2 s
    assert worker.stopped.is_set() and report.groups_delivered == 0
    assert queue.stats().released == 1 and 0.15 <= report.seconds < 5.0
