"""Held-out evaluation: greedy decoding with the rollout engine, scored by the task's verifier.

``evaluate`` is the accuracy every stage reports (SFT before/after, RL every ``eval.every`` steps):
the held-out *exact match*, the share of held-out prompts whose greedy response is correct by the task's
correctness (``Task.held_out_correct``: the reward's ``info["correct"]`` or the task's verifier; never
``score > 0``, which would count partial credit as correct). A task with no notion of correctness (a
dataset without answers, scored only by a user reward function) reports the mean held-out reward
instead, named so (``EvalResult.metric``, ``METRIC_NAMES``).

With ``eval.k`` > 0 each held-out prompt is also sampled n = ``eval.n`` times at ``eval.temperature``
(one request of n samples, seeded by the prompt id): ``pass@k`` is the unbiased estimator of Chen et al.
2021, "Evaluating Large Language Models Trained on Code", eq. 1, averaged over prompts, and ``mean@k`` the
mean correctness of all samples. A task with several validation sets is evaluated set by set
(``evaluate_sets``); ``eval_values`` names the metrics.

``teacher_forced_exact_match`` computes the same figure for single-answer tasks in one forward pass,
without generating: greedy decoding reproduces ``solution + eos`` exactly iff the argmax at every
completion position of the teacher-forced sequence is the next gold token. It is a cheap progress
signal during SFT and a cross-check of the engine in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from moerl.rollout import Completion, Engine, Request, SamplingParams
from moerl.tasks.base import Prompt, Task, score_many, stable_hash

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config import EvalConfig
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
    k: int = 0
    """``eval.k`` of the sampled eval (0: none was run; ``pass_at_k`` and ``mean_at_k`` are None)."""
    pass_at_k: float | None = None
    """Mean over prompts of 1 - C(n-c, k) / C(n, k), c of n samples correct (``pass_at_k``), in [0, 1];
    None without a sampled eval or a notion of correctness."""
    mean_at_k: float | None = None
    """Share of all sampled responses that are correct, in [0, 1]; None as ``pass_at_k``."""
    samples: tuple[dict, ...] = ()
    """The sampled responses: ``{"prompt_id", "sample_index", "response", "reward", "correct"}`` each
    (``correct`` 1.0/0.0, None without a notion of correctness), for ``eval_samples.jsonl``."""
    name: str = "held_out"
    """The validation set (``Task.eval_sets``)."""
    by_set: dict[str, EvalResult] = field(default_factory=dict)
    """With several validation sets (``evaluate_sets``): every set's result, this main one first."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one prompt with ``c`` of ``n`` samples correct:
    ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1), computed exactly with integers.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
    sampling: EvalConfig | None = None,
) -> EvalResult:
    """Greedy held-out accuracy (and with ``sampling.k`` > 0 the sampled pass@k) through ``moerl.rollout.Engine`` over a paged KV cache (any prompt and
    response up to ``kv_token_budget`` tokens fit).

    Args:
        model: a ``MoeForCausalLM`` (its training mode is restored afterwards).
        tokenizer: encodes prompts, decodes responses; generation stops at ``tokenizer.eos_id``.
        task: scores responses with ``task.reward``.
        prompts: defaults to ``task.eval_prompts()``.
        max_new_tokens: longest response in tokens.
        max_slots, kv_token_budget: engine sizes (concurrent sequences, KV cache tokens).
        sampling: the ``eval`` section (``k``, ``n``, ``temperature``); None: greedy only.

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
    requests = eval_requests(prompts, tokenizer, max_new_tokens, sampling)
    was_training = model.training
    model.eval()
    try:
        engine = Engine(model, cache="paged", max_slots=max_slots, kv_token_budget=kv_token_budget)
        completions = engine.generate(requests)
    finally:
        model.train(was_training)
    return score_completions(prompts, completions, tokenizer, task, sampling)


SAMPLED = "#sampled"
"""Suffix of the request id of a prompt's sampled eval request (``eval_requests``)."""


def eval_requests(
    prompts: list[Prompt], tokenizer: Tokenizer, max_new_tokens: int, sampling: EvalConfig | None = None
) -> list[Request]:
    """One greedy request per held-out prompt (request id = prompt id; at most ``max_new_tokens``
    tokens, stopping at ``tokenizer.eos_id``) and, with ``sampling.k`` > 0, one request of ``sampling.n``
    samples at ``sampling.temperature`` (id ``<prompt id>#sampled``, seeded by the prompt id): what
    ``evaluate`` generates, on any engine."""
    params = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,)
    )
    requests = []
    for p in prompts:
        ids = tokenizer.encode(p.text)
        requests.append(Request(request_id=p.id, prompt_ids=ids, params=params))
        if sampling is not None and sampling.k > 0:
            sampled = SamplingParams(
                temperature=sampling.temperature,
                max_new_tokens=max_new_tokens,
                stop_token_ids=(tokenizer.eos_id,),
                n=sampling.n,
                seed=stable_hash(p.id) % 2**31,
            )
            requests.append(Request(request_id=p.id + SAMPLED, prompt_ids=ids, params=sampled))
    return requests


def score_completions(
    prompts: list[Prompt],
    completions: list[Completion],
    tokenizer: Tokenizer,
    task: Task,
    sampling: EvalConfig | None = None,
) -> EvalResult:
    """``EvalResult`` of the completions of ``eval_requests(prompts, ..., sampling)`` (any order), scored
    by ``task.reward_many`` (the greedy responses in one batch, each prompt's samples in one more).

    Raises:
        KeyError: a prompt has no completion.
    """
    by_id: dict[str, list[Completion]] = {}
    for c in completions:
        by_id.setdefault(c.request_id, []).append(c)
    errors_before = task.num_reward_errors
    greedy = [by_id[p.id][0] for p in prompts]
    texts = [tokenizer.decode(c.token_ids) for c in greedy]
    verdicts = _verdicts(task, prompts, texts)
    n = len(prompts)
    rewards = [r for r, _ in verdicts]
    has_correctness = all(v is not None for _, v in verdicts)
    result = EvalResult(
        accuracy=sum(v for _, v in verdicts) / n if has_correctness else sum(rewards) / n,
        metric=EXACT_MATCH if has_correctness else MEAN_REWARD,
        mean_reward=sum(rewards) / n,
        num_prompts=n,
        mean_response_tokens=sum(len(c.token_ids) for c in greedy) / n,
        num_reward_errors=0,
    )
    if sampling is not None and sampling.k > 0:
        result = _with_samples(result, prompts, by_id, tokenizer, task, sampling.k)
    return replace(result, num_reward_errors=task.num_reward_errors - errors_before)


def _verdicts(task: Task, prompts: list[Prompt], texts: list[str]) -> list[tuple[float, float | None]]:
    """(reward score, correct verdict or None) of ``texts[i]`` answering ``prompts[i]``."""
    rewards = score_many(
        task, [p.text for p in prompts], texts, [p.answer for p in prompts], [p.extra for p in prompts]
    )
    return [
        (r.score, task.held_out_correct(p.text, t, p.answer, r))
        for p, t, r in zip(prompts, texts, rewards, strict=True)
    ]


def _with_samples(
    result: EvalResult, prompts: list[Prompt], by_id: dict, tokenizer: Tokenizer, task: Task, k: int
) -> EvalResult:
    """``result`` with the sampled eval of every prompt: pass@k (``pass_at_k`` averaged over prompts),
    mean@k and the samples."""
    samples: list[dict] = []
    estimates: list[float] = []
    for p in prompts:
        group = sorted(by_id[p.id + SAMPLED], key=lambda c: c.sample_index)
        texts = [tokenizer.decode(c.token_ids) for c in group]
        verdicts = _verdicts(task, [p] * len(group), texts)
        for c, text, (score, correct) in zip(group, texts, verdicts, strict=True):
            samples.append(
                {"prompt_id": p.id, "sample_index": c.sample_index, "response": text, "reward": score,
                 "correct": correct}
            )  # fmt: skip
        if all(v is not None for _, v in verdicts):
            estimates.append(pass_at_k(len(group), int(sum(v for _, v in verdicts)), k))
    known = len(estimates) == len(prompts)
    correct = [s["correct"] for s in samples]
    return replace(
        result,
        k=k,
        pass_at_k=sum(estimates) / len(estimates) if known else None,
        mean_at_k=sum(correct) / len(correct) if known else None,
        samples=tuple(samples),
    )


def evaluate_sets(
    sets: dict[str, list[Prompt]], evaluate_one: Callable[[list[Prompt]], EvalResult]
) -> EvalResult:
    """Evaluate every validation set with ``evaluate_one(prompts)``; returns the first (main) set's result,
    carrying every set's in ``by_set`` when there are several (each ``name``d).

    Raises:
        ValueError: no sets.
    """
    if not sets:
        raise ValueError("no validation sets to evaluate")
    results = {name: replace(evaluate_one(prompts), name=name) for name, prompts in sets.items()}
    main = next(iter(results.values()))
    return replace(main, by_set=results) if len(results) > 1 else main


def eval_keys(k: int, set_names: list[str]) -> list[str]:
    """The metric names of an eval beyond ``eval/accuracy`` and ``eval/mean_reward``: ``eval/pass@<k>`` and
    ``eval/mean@<k>`` when ``k`` > 0, and with several sets ``eval/<name>/accuracy``,
    ``eval/<name>/mean_reward`` (and their pass@k, mean@k) for each."""
    sampled = [f"pass@{k}", f"mean@{k}"] if k > 0 else []
    keys = [f"eval/{m}" for m in sampled]
    if len(set_names) > 1:
        keys += [f"eval/{name}/{m}" for name in set_names for m in ("accuracy", "mean_reward", *sampled)]
    return keys


def eval_values(result: EvalResult | None, keys: list[str]) -> dict[str, float | None]:
    """The values of ``keys`` (``eval_keys``) from one eval; all None when the step had none."""
    values: dict[str, float | None] = dict.fromkeys(keys)
    if result is None:
        return values
    for name, r in [(None, result), *result.by_set.items()]:
        prefix = "eval/" if name is None else f"eval/{name}/"
        figures = {
            "accuracy": r.accuracy if r.metric == EXACT_MATCH else None,
            "mean_reward": r.mean_reward,
            f"pass@{r.k}": r.pass_at_k,
            f"mean@{r.k}": r.mean_at_k,
        }
        for metric, value in figures.items():
            if prefix + metric in values:
                values[prefix + metric] = value
    return values


def sample_records(result: EvalResult, step: int) -> list[dict]:
    """The sampled eval responses of one eval (every set), one JSON-ready dict each, for
    ``RUN_DIR/eval_samples.jsonl``: ``{"step", "set", "k", "prompt_id", "sample_index", "response",
    "reward", "correct"}``."""
    results = list(result.by_set.values()) or [result]
    return [{"step": step, "set": r.name, "k": r.k, **s} for r in results for s in r.samples]


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
