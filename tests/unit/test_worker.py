"""RolloutWorker: lease -> generate -> score -> put (settles the lease), weight sync, refusals, sync fleet."""

from types import SimpleNamespace

import pytest
import torch
from _tiny import tiny_model

from moerl.config import RolloutConfig
from moerl.rollout import Engine
from moerl.runtime.buffer import ExperienceBuffer
from moerl.runtime.local import LocalRollouts
from moerl.runtime.queue import TaskQueue
from moerl.runtime.worker import RolloutWorker, sample_seed
from moerl.tasks import Prompt, Reward, load_tokenizer
from moerl.weights.sources import LocalWeights

TOK = load_tokenizer(None)


class CountTask:
    """Reward = fraction of response characters that are '1'; raises on prompts marked 'boom'."""

    def reward(self, prompt_text, response_text, answer):
        if "boom" in prompt_text:
            return Reward(0.0, {"error": 1.0})
        return Reward(response_text.count("1") / max(len(response_text), 1), {})


def _prompts(texts):
    for i, text in enumerate(texts):
        yield Prompt(id=f"p{i}", text=text, answer="1")


def _setup(texts, *, clock=None, group_size=3, weights=None):
    model = tiny_model(TOK.vocab_size)
    queue = TaskQueue(
        _prompts(texts), num_samples=group_size, tokenize=TOK.encode, **({"clock": clock} if clock else {})
    )
    buffer = ExperienceBuffer(8, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    cfg = RolloutConfig(group_size=group_size, max_new_tokens=4, max_slots=6, kv_token_budget=6 * 64)
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    worker = RolloutWorker(
        "w0",
        engine,
        CountTask(),
        TOK.decode,
        queue,
        buffer,
        cfg,
        stop_token_ids=(TOK.eos_id,),
        weights=weights,
        run_seed=7,
    )
    return model, queue, buffer, worker


def test_run_delivers_scored_groups_and_settles_leases():
    _, queue, buffer, worker = _setup(["1+1=", "2+2=", "3+3=", "boom="])
    assert worker.max_groups_in_flight == 2  # 6 slots / 3 samples
    assert worker.run(num_groups=4) == 4
    groups = buffer.get(4, timeout=0)
    assert len({g.task_id for g in groups}) == 4
    for g in groups:
        assert len(g.samples) == 3
        for s in g.samples:
            assert 1 <= len(s.response_ids) <= 4 and s.policy_versions == (0,) * len(s.response_ids)
            text = TOK.decode(list(s.response_ids))
            if "boom" not in g.task.prompt_text:
                assert s.reward == pytest.approx(text.count("1") / max(len(text), 1))
    stats = queue.stats()
    assert (stats.leased, stats.acked, stats.outstanding) == (4, 4, 0)
    assert worker.stats.groups_admitted == 4 and worker.stats.reward_errors == 3  # the 'boom' group's samples


def test_same_seed_same_samples_and_seed_depends_on_attempt():
    assert sample_seed(0, "t", 1) == sample_seed(0, "t", 1) != sample_seed(0, "t", 2)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        _, _, buffer, worker = _setup(["12+3="])
        worker.run(num_groups=1)
        outs.append([s.response_ids for s in buffer.get(1, timeout=0)[0].samples])
    assert outs[0] == outs[1]


def test_new_weights_are_loaded_between_steps_and_tag_tokens():
    weights = LocalWeights()
    model, _, buffer, worker = _setup(["1+1=", "2+2="], weights=weights)
    new = {
        k: torch.zeros_like(v) if k == "lm_head.weight" else v.clone() for k, v in model.state_dict().items()
    }
    weights.push(5, new)
    buffer.set_version(5)
    worker.run(num_groups=1)
    assert worker.version == 5 and worker.stats.weight_updates == 1
    assert torch.equal(worker.engine.model.lm_head.weight, torch.zeros_like(model.lm_head.weight))
    assert set(buffer.get(1, timeout=0)[0].samples[0].policy_versions) == {5}


def test_expired_lease_delivery_is_refused_and_release_requeues():
    now = [0.0]
    _, queue, buffer, worker = _setup(["1+1=", "2+2="], clock=lambda: now[0])
    worker.lease_ttl_s = 10.0
    worker._lease_more(budget=1)
    now[0] = 100.0  # the lease expires while generating
    while worker.num_in_flight:
        worker.step(budget=0)
    assert worker.stats.groups_refused == 1 and buffer.metrics().depth == 0
    assert queue.stats().expired == 1 and queue.stats().refused == 1
    worker._lease_more(budget=1)
    assert worker.release_all() == 1 and queue.stats().released == 1


def test_local_fleet_generates_exactly_a_batch_on_policy():
    model, queue, buffer, worker = _setup([f"{i}+1=" for i in range(10)], weights=LocalWeights())
    fleet = LocalRollouts(queue, buffer, worker, worker.weights)
    groups, gen_s, wait_s = fleet.next_groups(3)
    assert len(groups) == 3 and gen_s > 0 and wait_s == 0.0 and fleet.buffer_metrics().depth == 0
    fleet.publish(SimpleNamespace(version=1, named_weights=model.state_dict))  # no store: not written
    groups, _, _ = fleet.next_groups(2)
    assert {g.min_policy_version for g in groups} == {1}
    state = fleet.final_state()
    assert state.queue.acked == 5 and state.buffered_task_ids == () and state.reward_errors == 0


def test_worker_keeps_its_paged_engines_kv_stats_for_the_metrics():
    from moerl.telemetry.step import kv_values

    model = tiny_model(TOK.vocab_size)
    queue = TaskQueue(_prompts(["1+1=", "2+2=", "3+3="]), num_samples=4, tokenize=TOK.encode)
    buffer = ExperienceBuffer(8, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    cfg = RolloutConfig(group_size=4, max_new_tokens=4, max_slots=8, kv_token_budget=8 * 64)
    engine = Engine(model, cache="paged", max_slots=8, kv_token_budget=64, block_size=4)
    worker = RolloutWorker(
        "w0", engine, CountTask(), TOK.decode, queue, buffer, cfg, stop_token_ids=(TOK.eos_id,), run_seed=7
    )
    assert worker.stats.kv is None and kv_values([worker.stats.kv]) == {}
    assert worker.run(num_groups=3) == 3
    kv = worker.stats.kv
    assert kv == engine.stats and kv.blocks_total == 16 and kv.prefix_hit_tokens >= 3 * 3 * 4
    values = kv_values([kv, kv])
    assert (
        values["rollout/kv_blocks_total"] == 32
        and values["rollout/kv_prefill_tokens"] == 2 * kv.prefill_tokens
    )
    assert values["rollout/kv_decoding_together_mean"] == kv.mean_decode_batch > 1
