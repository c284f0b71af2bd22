"""A held-out eval on a rollout worker (issue 34): ``RolloutWorker.generate_alone`` and the actor's
version gate (``RolloutWorkerActor.evaluate``)."""

import threading
import time
from types import SimpleNamespace

import torch
from _tiny import tiny_model
from test_worker_pipeline import TOK, _setup

from moerl.config import load_config
from moerl.rollout import Completion, Engine
from moerl.runtime.ray.worker_actor import RolloutWorkerActor
from moerl.tasks import Prompt, Reward
from moerl.tasks.eval import eval_requests

PROMPTS = [Prompt(id=f"e{i}", text=f"{i}*3=", answer="3") for i in range(7)]


def test_generate_alone_equals_a_fresh_engine_and_hands_the_groups_in_flight_back():
    queue, _, _, _, worker = _setup(max_new_tokens=6)
    worker.step()  # groups in flight, part-generated
    in_flight = worker.num_in_flight
    assert in_flight and queue.stats().released == 0
    requests = eval_requests(PROMPTS, TOK, max_new_tokens=5)
    got = {c.request_id: c.token_ids for c in worker.generate_alone(requests)}
    torch.manual_seed(0)
    fresh = Engine(tiny_model(TOK.vocab_size), max_slots=6, kv_token_budget=6 * 64)  # _setup's policy
    want = {c.request_id: c.token_ids for c in fresh.generate(requests)}
    assert got == want and len(got) == len(PROMPTS) and any(want.values())
    stats = queue.stats()  # every group in flight is back in the queue, none left leased
    assert not worker.num_in_flight and stats.released == in_flight and stats.outstanding == 0
    assert worker.stats.groups_aborted == in_flight


class _Task:
    num_reward_errors = 0

    def reward(self, prompt_text, response_text, answer):
        ok = float(response_text == answer)
        return Reward(ok, {"correct": ok})

    def held_out_correct(self, prompt_text, response_text, answer, reward):
        return reward.info["correct"]


def _actor(version: int, replies: list):
    """A ``RolloutWorkerActor`` without Ray or model: its worker answers each eval with ``replies``."""
    actor = object.__new__(RolloutWorkerActor)
    actor.cfg, actor.tokenizer, actor.group = load_config(None), TOK, None
    actor._evals, actor._evals_lock, actor._offered = [], threading.Lock(), threading.Event()
    actor.source = None  # no weight source: no version refused
    actor.snapshots = None  # no progress snapshots (fleet.snapshot_tokens: a sender thread per worker)

    def generate_alone(requests):
        text = replies.pop(0)
        return [
            Completion(
                request_id=r.request_id,
                sample_index=0,
                prompt_ids=r.prompt_ids,
                token_ids=TOK.encode(text),
                logprobs=[],
                finish_reason="stop",
                policy_versions=[],
            )
            for r in requests
        ]

    actor.worker = SimpleNamespace(
        version=version, task=_Task(), worker_id="w0", generate_alone=generate_alone
    )
    return actor


def test_an_eval_waits_for_its_version_and_refuses_a_newer_engine():
    actor = _actor(1, ["3", "4"])
    result = {}
    caller = threading.Thread(target=lambda: result.update(r=actor.evaluate(PROMPTS, 2, timeout_s=10)))
    caller.start()
    while not actor._evals:
        threading.Event().wait(0.01)
    actor._serve_evals()  # the engine holds v1: nothing served
    assert len(actor._evals) == 1 and caller.is_alive()
    actor.worker.version = 2
    actor._serve_evals()
    caller.join(5)
    assert result["r"].accuracy == 1.0 and result["r"].num_prompts == len(PROMPTS)
    actor.worker.version = 3  # moved past the version asked: an error, not another version's figure
    caller = threading.Thread(target=lambda: result.update(e=_error(lambda: actor.evaluate(PROMPTS, 2, 10))))
    caller.start()
    while not actor._evals:
        threading.Event().wait(0.01)
    actor._serve_evals()
    caller.join(5)
    assert "the engine holds v3, newer than the version asked" in result["e"]


def _error(call) -> str:
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return ""


def test_an_idle_worker_loop_backs_off_between_lease_attempts():
    """Nothing in flight (queue gated, buffer full): each loop pass asks the exchange for a lease, so the
    loop waits 10 ms, then longer while nothing comes (``IDLE_WAIT_S``), instead of asking 100 times a
    second."""
    from moerl.runtime.ray.worker_actor import IDLE_WAIT_S

    actor = _actor(0, [])
    steps: list[float] = []
    actor.worker.step = lambda: steps.append(time.monotonic())
    actor.worker.num_in_flight = 0
    actor.worker.request_stop = actor.worker.release_all = lambda: None
    actor._stop, actor._paused = threading.Event(), threading.Event()
    actor.watcher = SimpleNamespace(is_set=lambda: False, stop=lambda **kw: None)
    actor.slowdown = SimpleNamespace(after_step=lambda s: None)
    actor.health = lambda: None
    loop = threading.Thread(target=actor.run)
    loop.start()
    time.sleep(1.0)
    actor.stop()
    loop.join(5)
    assert not loop.is_alive()
    # 10 + 20 + 40 + 80 ms, then every 100 ms: about 12 asks in a second (at a fixed 10 ms: up to 100)
    assert 5 <= len(steps) <= 16, len(steps)
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert max(gaps) < IDLE_WAIT_S[1] + 0.05 and gaps[-1] > 0.5 * IDLE_WAIT_S[1], gaps
