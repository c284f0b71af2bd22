"""``rollout.on_weight_update``: continue (mixed versions), recompute (a fresh prefill's tokens after the
update), abort (tasks released and regenerated at the new version)."""

import copy

import pytest
import torch
from _tiny import tiny_model, tiny_model_config

from moerl.config import ConfigError, RolloutConfig
from moerl.models import build_model
from moerl.rollout import Engine, Request, SamplingParams
from moerl.rollout.weight_update import cancel_all, recompute_running
from moerl.runtime.buffer import ExperienceBuffer
from moerl.runtime.queue import TaskQueue
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Prompt, Reward, load_tokenizer
from moerl.weights.sources import LocalWeights

VOCAB = 61
TOK = load_tokenizer(None)


def _decisive(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = build_model(tiny_model_config(num_layers=2, max_position_embeddings=128), VOCAB)
    with torch.no_grad():  # O(1) weights: decisive logits, so greedy comparisons are meaningful
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m


@pytest.fixture(scope="module")
def models():
    return _decisive(0), _decisive(1)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _greedy(rid, prompt, n_new):
    return Request(
        request_id=rid, prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=n_new)
    )


def _run_with_update(models, policy: str, steps_before: int = 4):
    old, new = models
    engine = Engine(copy.deepcopy(old), max_slots=4, kv_token_budget=4 * 64)
    for i, p in enumerate(_prompts()):
        engine.add_request(_greedy(f"r{i}", p, 12))
    done = []
    for _ in range(steps_before):
        done += engine.step()
    engine.update_weights(new.state_dict(), 1)
    if policy == "recompute":
        done += recompute_running(engine)
    while engine.num_unfinished:
        done += engine.step()
    return sorted(done, key=lambda c: c.request_id)


def _fresh_continuations(models, outs):
    """For each completion: a fresh engine under the new weights, prefilled with the prompt and the
    tokens sampled before the update, run greedily for the remaining tokens."""
    ref = Engine(copy.deepcopy(models[1]), max_slots=4, kv_token_budget=4 * 64)
    reqs = []
    for c in outs:
        k = c.policy_versions.count(0)
        reqs.append(_greedy(c.request_id, c.prompt_ids + c.token_ids[:k], len(c.token_ids) - k))
    return {c.request_id: c for c in ref.generate(reqs)}


def test_recompute_tokens_after_update_equal_a_fresh_prefill(models):
    outs = _run_with_update(models, "recompute")
    fresh = _fresh_continuations(models, outs)
    for c in outs:
        k = c.policy_versions.count(0)
        assert 0 < k < len(c.token_ids) and c.policy_versions == [0] * k + [1] * (len(c.token_ids) - k)
        assert c.token_ids[k:] == fresh[c.request_id].token_ids
        assert c.logprobs[k:] == pytest.approx(fresh[c.request_id].logprobs, abs=1e-5)


def test_continue_keeps_old_cache_so_it_differs_from_a_fresh_prefill(models):
    outs = _run_with_update(models, "continue")
    fresh = _fresh_continuations(models, outs)
    worst = 0.0
    for c in outs:
        k = c.policy_versions.count(0)
        assert c.policy_versions == [0] * k + [1] * (len(c.token_ids) - k)  # mixed per-token versions
        f = fresh[c.request_id]
        worst = max(worst, abs(c.logprobs[k] - f.logprobs[0]))
    assert worst > 1e-3  # the old weights' keys/values change later log-probs: what recompute avoids


def test_cancel_all_empties_the_engine(models):
    engine = Engine(copy.deepcopy(models[0]), max_slots=2, kv_token_budget=2 * 64)
    for i, p in enumerate(_prompts()):
        engine.add_request(_greedy(f"r{i}", p, 12))
    engine.step()
    assert cancel_all(engine) == 2 and engine.num_unfinished == 0
    engine.add_request(_greedy("again", _prompts()[0], 3))  # the same engine still serves requests
    assert len([c for _ in range(5) for c in engine.step()]) == 1


class OnesTask:
    def reward(self, prompt_text, response_text, answer):
        return Reward(float("1" in response_text), {})


def _worker(policy: str):
    torch.manual_seed(0)
    model = tiny_model(TOK.vocab_size)
    prompts = (Prompt(id=f"p{i}", text=f"{i}+1=", answer="1") for i in range(4))
    queue = TaskQueue(prompts, num_samples=2, tokenize=TOK.encode)
    buffer = ExperienceBuffer(8, max_staleness=5, settle=queue.settle, requeue=queue.requeue)
    cfg = RolloutConfig(
        group_size=2,
        max_new_tokens=6,
        max_slots=4,
        kv_token_budget=4 * 64,
        lease_ahead_groups=0,
        on_weight_update=policy,
    )
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    weights = LocalWeights()
    worker = RolloutWorker(
        "w0", engine, OnesTask(), TOK.decode, queue, buffer, cfg, stop_token_ids=(), weights=weights
    )
    return model, queue, buffer, worker, weights


@pytest.mark.parametrize("policy", ["continue", "recompute", "abort"])
def test_worker_policies_deliver_every_task_once_with_versions(policy):
    model, queue, buffer, worker, weights = _worker(policy)
    worker.step()
    worker.step()  # two groups in flight, two tokens each
    assert worker.num_in_flight == 2
    weights.push(1, {k: v + 0.01 for k, v in model.state_dict().items()})
    delivered = worker.run(num_groups=4)
    groups = buffer.get(4, timeout=0)
    assert delivered == 4 and sorted(g.task_id for g in groups) == sorted({g.task_id for g in groups})
    versions = [set(s.policy_versions) for g in groups for s in g.samples]
    stats = queue.stats()
    if policy == "abort":
        assert worker.stats.groups_aborted == 2 and stats.released == 2
        assert all(v == {1} for v in versions)  # the aborted groups were generated again at v1
    else:
        assert worker.stats.groups_aborted == 0 and stats.released == 0
        assert {0, 1} in versions  # the groups in flight at the update carry both versions
    assert stats.acked == 4 and stats.outstanding == 0


def test_on_weight_update_is_validated():
    with pytest.raises(ConfigError, match="rollout.on_weight_update"):
        RolloutConfig(on_weight_update="restart")
