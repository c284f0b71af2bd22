"""A real rollout worker over a real task queue and experience buffer, as a pod would run one: the
notice tests (IMDSv2, SIGTERM) drive it in this process or in a child process."""

import torch
from _tiny import tiny_model

from moerl.config import RolloutConfig
from moerl.rollout import Engine
from moerl.runtime.buffer import ExperienceBuffer
from moerl.runtime.queue import TaskQueue
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Prompt, Reward, load_tokenizer

TOK = load_tokenizer(None)
MAX_NEW = 12
NUM_PROMPTS = 20


class _Task:
    def reward(self, prompt_text, response_text, answer):
        return Reward(float(response_text.startswith(answer)), {})


def rig(worker_id="w0"):
    """(worker, queue, buffer): 20 prompts of 3 samples, 12 new tokens each, no stop token."""
    torch.manual_seed(0)
    model = tiny_model(TOK.vocab_size)
    prompts = (Prompt(id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i)) for i in range(NUM_PROMPTS))
    queue = TaskQueue(prompts, num_samples=3, tokenize=TOK.encode)
    buffer = ExperienceBuffer(64, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    return new_worker(worker_id, queue, buffer, model), queue, buffer


def new_worker(worker_id, queue, buffer, model=None):
    cfg = RolloutConfig(
        group_size=3, max_new_tokens=MAX_NEW, max_slots=6, kv_token_budget=6 * 64, lease_ahead_groups=0
    )
    model = model or tiny_model(TOK.vocab_size)
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget)
    return RolloutWorker(
        worker_id, engine, _Task(), TOK.decode, queue, buffer, cfg, stop_token_ids=(), run_seed=1
    )


def run_until_notice(worker, watcher, *, on_step=None, max_steps=100_000):
    """The actor's loop (``RolloutWorkerActor.run``): step until the watcher has a notice."""
    steps = 0
    while not watcher.is_set() and steps < max_steps:
        worker.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
    return steps
