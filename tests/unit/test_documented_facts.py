"""Facts that docstrings state, checked against the code: R3 rows per sample, drain deadline, buffer wait."""

from __future__ import annotations

import pytest
from _tiny import tiny_model_config
from test_drain import Clock, ScriptedWorker, _queue
from test_worker import TOK, CountTask, _prompts

from moerl.config import RolloutConfig
from moerl.models import build_model
from moerl.rollout import Engine
from moerl.runtime.buffer import ExperienceBuffer
from moerl.runtime.drain import Drainer
from moerl.runtime.notice import TerminationNotice
from moerl.runtime.queue import TaskQueue
from moerl.runtime.worker import RolloutWorker


def test_sample_routed_experts_has_one_row_per_fed_token():
    """``Sample.routed_experts``: [P + R - 1, L_moe, k] (the last response token is never fed)."""
    model_cfg = tiny_model_config(num_layers=2)
    model = build_model(model_cfg, TOK.vocab_size)
    queue = TaskQueue(_prompts(["1+1=", "22+3="]), num_samples=2, tokenize=TOK.encode)
    buffer = ExperienceBuffer(4, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    cfg = RolloutConfig(
        group_size=2, max_new_tokens=5, max_slots=4, kv_token_budget=4 * 64, return_routed_experts=True
    )
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    worker = RolloutWorker(
        "w0", engine, CountTask(), TOK.decode, queue, buffer, cfg, stop_token_ids=(TOK.eos_id,), run_seed=1
    )
    assert worker.run(num_groups=2) == 2
    samples = [s for g in buffer.get(2, timeout=0) for s in g.samples]
    assert len(samples) == 4
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert s.routed_experts.shape == (p + r - 1, 2, 2)  # L_moe = 2 layers, k = 2


def test_drain_deadline_counts_from_the_drain_start_not_the_notice():
    clock = Clock()
    queue = _queue(clock)
    clock.t = 100.0  # the notice (no deadline of its own) arrived 100 s before the drain starts
    worker = ScriptedWorker(queue, clock, [3, 20])
    notice = TerminationNotice("manual", "terminate", received_at=0.0)
    report = Drainer(10.0, clock=clock).drain(worker, notice)
    # deadline 100 + 10 = 110: the 3-token group finishes at 103; the 20-token one is projected to end
    # at 101 + 19 x 1 s = 120 and is released after the first timed step (one token per sample, n = 2)
    assert report.grace_s == 10.0
    assert (report.groups_delivered, report.groups_released, report.tokens_discarded) == (1, 1, 2)


def test_buffer_get_wait_counts_timed_out_calls():
    buffer = ExperienceBuffer(2, max_staleness=0)
    with pytest.raises(TimeoutError):
        buffer.get(1, timeout=0.05)
    waited = buffer.metrics().get_wait_s
    assert waited >= 0.05  # the whole blocked call, though it returned nothing
    with pytest.raises(TimeoutError):
        buffer.get(1, timeout=0.0)
    assert buffer.metrics().get_wait_s >= waited
