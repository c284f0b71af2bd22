"""Drain of a real RolloutWorker over a real queue and buffer; the next worker resumes kept prefixes."""

import pytest
import torch
from _tiny import tiny_model

from moerl.config import RolloutConfig
from moerl.rollout import Engine
from moerl.runtime.buffer import ExperienceBuffer
from moerl.runtime.drain import Drainer
from moerl.runtime.queue import TaskQueue
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Prompt, Reward, load_tokenizer

TOK = load_tokenizer(None)
MAX_NEW = 12


class OneTask:
    def reward(self, prompt_text, response_text, answer):
        return Reward(float(response_text.startswith(answer)), {})


def _worker(queue, buffer, model, worker_id, lease_ahead=0):
    cfg = RolloutConfig(
        group_size=3,
        max_new_tokens=MAX_NEW,
        max_slots=6,
        kv_token_budget=6 * 64,
        lease_ahead_groups=lease_ahead,
    )
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    # no stop token: every response runs to MAX_NEW tokens, so progress is predictable
    return RolloutWorker(
        worker_id, engine, OneTask(), TOK.decode, queue, buffer, cfg, stop_token_ids=(), run_seed=1
    )


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = tiny_model(TOK.vocab_size)
    prompts = (Prompt(id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i)) for i in range(20))
    queue = TaskQueue(prompts, num_samples=3, tokenize=TOK.encode)
    buffer = ExperienceBuffer(16, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    return model, queue, buffer


def test_progress_and_zero_grace_release(setup):
    model, queue, buffer = setup
    worker = _worker(queue, buffer, model, "w0")
    for _ in range(4):
        worker.step()
    groups = worker.in_flight()
    assert len(groups) == 2 and all(len(g.prefixes) == 3 for g in groups)
    # step 1 prefills (first token) and decodes one more; steps 2-4 decode one each: 5 tokens per sample
    assert [g.num_tokens for g in groups] == [15, 15] and groups[0].max_tokens_left == MAX_NEW - 5
    report = Drainer(0.0).drain(worker)
    assert (report.groups_released, report.groups_delivered) == (2, 0)
    assert report.tokens_discarded == sum(g.num_tokens for g in groups)
    assert worker.num_in_flight == 0 and queue.stats().released == 2 and queue.stats().outstanding == 0
    assert worker.step() == []  # no new lease after a drain; leftover engine work is ignored
    assert worker.stats.groups_put == 0


def test_zero_grace_also_releases_groups_leased_ahead(setup):
    model, queue, buffer = setup
    worker = _worker(queue, buffer, model, "w0", lease_ahead=2)
    worker.step()  # 2 groups running in the 6 slots, 2 more queued in the engine
    assert worker.num_in_flight == 4 and queue.stats().outstanding == 4
    assert sorted(g.num_tokens for g in worker.in_flight()) == [0, 0, 6, 6]  # prefill + 1 decode each
    report = Drainer(0.0).drain(worker)
    assert report.groups_released == 4 and queue.stats().released == 4 and queue.stats().outstanding == 0


def test_generous_grace_delivers_everything(setup):
    model, queue, buffer = setup
    worker = _worker(queue, buffer, model, "w0")
    worker.step()
    report = Drainer(600.0).drain(worker)
    assert (report.groups_delivered, report.groups_released, report.tokens_discarded) == (2, 0, 0)
    assert buffer.metrics().depth == 2 and queue.stats().acked == 2


def test_kept_prefixes_are_resumed_by_the_next_worker(setup):
    model, queue, buffer = setup
    first = _worker(queue, buffer, model, "w0")
    for _ in range(5):
        first.step()
    before = {g.lease.task_id: g.prefixes for g in first.in_flight()}
    report = Drainer(0.0, keep_partial=True).drain(first)
    assert report.groups_released == 2 and report.tokens_kept == sum(
        len(p.response_ids) for ps in before.values() for p in ps
    )
    second = _worker(queue, buffer, model, "w1")
    assert second.run(num_groups=2) == 2
    for g in buffer.get(2, timeout=0):
        assert g.task.attempt == 2 and g.worker_id == "w1"
        for s, p in zip(g.samples, before[g.task_id], strict=True):
            assert len(s.response_ids) == MAX_NEW
            assert s.response_ids[: len(p.response_ids)] == p.response_ids  # continued, not restarted
            assert s.response_logprobs[: len(p.response_ids)] == p.response_logprobs
    assert queue.stats().acked == 2
