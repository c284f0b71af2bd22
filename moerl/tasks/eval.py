"""Held-out evaluation: greedy decoding with the rollout engine, scored by the task's verifier.

``evaluate`` is the accuracy every stage reports (SFT before/after, RL every ``eval.every`` steps):
the share of held-out prompts whose greedy response the task scores as correct
(``Reward.info["correct"]``; for arithmetic that is exact match of the answer).

``teacher_forced_exact_match`` computes the same figure for single-answer tasks in one forward pass,
without generating: greedy decoding reproduces ``solution + eos`` exactly iff the argmax at every
completion position of the teacher-forced sequence is the next gold token. It is a cheap progress
signal during SFT and a cross-check of the engine in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.rollout import Completion, PagedEngine, Request, SamplingParams
from moerl.tasks.base import Prompt, Task
from moerl.tasks.examples import collate, encode_example
from moerl.tasks.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Held-out accuracy of one evaluation.

    Attributes:
        accuracy: mean of ``info["correct"]`` over the prompts, in [0, 1] (a reward function that
            reports no ``correct`` counts a response as correct when its score is > 0).
        mean_reward: mean ``Reward.score``.
        num_prompts: prompts evaluated.
        mean_response_tokens: mean generated tokens per response (stop token included).
        num_reward_errors: responses whose reward function raised (scored 0).
    """

    accuracy: float
    mean_reward: float
    num_prompts: int
    mean_response_tokens: float
    num_reward_errors: int


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    task: Task,
    prompts: list[Prompt] | None = None,
    *,
    max_new_tokens: int = 16,
    max_slots: int = 64,
    kv_token_budget: int = 16384,
) -> EvalResult:
    """Greedy held-out accuracy through ``moerl.rollout.PagedEngine`` (a paged KV cache: any prompt and
    response up to ``kv_token_budget`` tokens fit).

    Args:
        model: a ``MoeForCausalLM`` (its training mode is restored afterwards).
        tokenizer: encodes prompts, decodes responses; generation stops at ``tokenizer.eos_id``.
        task: scores responses with ``task.reward``.
        prompts: defaults to ``task.eval_prompts()``.
        max_new_tokens: longest response in tokens.
        max_slots, kv_token_budget: engine sizes (concurrent sequences, KV cache tokens).

    A task with an ``evaluate_episodes`` method (multi-turn environments, ``moerl.envs.task``) is
    evaluated by it instead: greedy episodes, accuracy from the environment's final ``correct``.

    Raises:
        ValueError: no prompts to evaluate.
    """
    prompts = task.eval_prompts() if prompts is None else prompts
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if hasattr(task, "evaluate_episodes"):
        return task.evaluate_episodes(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            max_slots=max_slots,
            kv_token_budget=kv_token_budget,
        )
    requests = eval_requests(prompts, tokenizer, max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        engine = PagedEngine(model, max_slots=max_slots, kv_token_budget=kv_token_budget)
        completions = engine.generate(requests)
    finally:
        model.train(was_training)
    return score_completions(prompts, completions, tokenizer, task)


def eval_requests(prompts: list[Prompt], tokenizer: Tokenizer, max_new_tokens: int) -> list[Request]:
    """One greedy request per held-out prompt (request id = prompt id; at most ``max_new_tokens``
    tokens, stopping at ``tokenizer.eos_id``): what ``evaluate`` generates, on any engine."""
    params = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,)
    )
    return [Request(request_id=p.id, prompt_ids=tokenizer.encode(p.text), params=params) for p in prompts]


def score_completions(
    prompts: list[Prompt], completions: list[Completion], tokenizer: Tokenizer, task: Task
) -> EvalResult:
    """``EvalResult`` of the completions of ``eval_requests(prompts, ...)`` (any order), scored by
    ``task.reward``.

    Raises:
        KeyError: a prompt has no completion.
    """
    by_id = {c.request_id: c for c in completions}
    errors_before = task.num_reward_errors
    correct = score = num_tokens = 0.0
    for p in prompts:
        c = by_id[p.id]
        reward = task.reward(p.text, tokenizer.decode(c.token_ids), p.answer)
        correct += reward.info.get("correct", float(reward.score > 0))
        score += reward.score
        num_tokens += len(c.token_ids)
    n = len(prompts)
    return EvalResult(
        accuracy=correct / n,
        mean_reward=score / n,
        num_prompts=n,
        mean_response_tokens=num_tokens / n,
        num_reward_errors=task.num_reward_errors - errors_before,
    )


@torch.no_grad()
def teacher_forced_exact_match(
    model: torch.nn.Module, tokenizer: Tokenizer, prompts: list[Prompt], batch_size: int = 256
) -> float:
    """Share of prompts whose greedy response would be exactly ``solution + eos`` (see module docstring).

    Raises:
        ValueError: a prompt has no ``solution``.
    """
    was_training = model.training
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model.eval()
    hits = 0
    try:
        for start in range(0, len(prompts), batch_size):
            batch = collate(
                [encode_example(tokenizer, p) for p in prompts[start : start + batch_size]],
                tokenizer.pad_id,
                device,
            )
            logits = model(batch.input_ids, batch.attention_mask).logits  # [B, T, V]
            predicted = logits[:, :-1].argmax(-1)  # [B, T-1]: prediction of token t+1
            target_mask = batch.loss_mask[:, 1:].bool()
            ok = (predicted == batch.input_ids[:, 1:]) | ~target_mask
            hits += int(ok.all(dim=-1).sum())
    finally:
        model.train(was_training)
    return hits / max(1, len(prompts))
