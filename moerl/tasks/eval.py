"""Held-out evaluation: greedy decoding with the rollout engine, scored by the task's verifier.

``evaluate`` is the accuracy every stage reports (SFT before/after, RL every ``eval.every`` steps):
the held-out *exact match*, the share of held-out prompts whose greedy response is correct by the task's
correctness (``Task.held_out_correct``: the reward's ``info["correct"]`` or the task's verifier; never
``score > 0``, which would count partial credit as correct). A task with no notion of correctness (a
dataset without answers, scored only by a user reward function) reports the mean held-out reward
instead, named so (``EvalResult.metric``, ``METRIC_NAMES``).

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

EXACT_MATCH, MEAN_REWARD = "exact_match", "mean_reward"
METRIC_NAMES = {EXACT_MATCH: "held-out exact match", MEAN_REWARD: "mean held-out reward"}
"""What ``EvalResult.accuracy`` is, by ``EvalResult.metric``, in the words the console uses."""


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Held-out accuracy of one evaluation.

    Attributes:
        accuracy: the headline figure: with ``metric == "exact_match"`` the share of prompts whose response
            is correct (``Task.held_out_correct``), in [0, 1]; with ``metric == "mean_reward"`` (the task has
            no notion of correctness) the mean reward, ``mean_reward``.
        metric: ``"exact_match"`` or ``"mean_reward"`` (``METRIC_NAMES``).
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
    metric: str = EXACT_MATCH


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
    score = num_tokens = 0.0
    verdicts: list[float | None] = []
    for p in prompts:
        c = by_id[p.id]
        text = tokenizer.decode(c.token_ids)
        reward = task.reward(p.text, text, p.answer)
        verdicts.append(task.held_out_correct(p.text, text, p.answer, reward))
        score += reward.score
        num_tokens += len(c.token_ids)
    n = len(prompts)
    has_correctness = all(v is not None for v in verdicts)
    return EvalResult(
        accuracy=sum(verdicts) / n if has_correctness else score / n,
        metric=EXACT_MATCH if has_correctness else MEAN_REWARD,
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
