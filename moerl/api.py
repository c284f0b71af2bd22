"""moerl's Python entry points: ``generate`` (offline generation on a run's rollout engine).

    from moerl.api import generate

    samples = generate("runs/x/policy", ["12+34=", [{"role": "user", "content": "Hi"}]], n=4, temperature=1.0)
    samples[0].completion, samples[0].logprobs

The same engine and prompt rendering as ``moerl generate`` (``moerl.generation``; ``moerl/rollout/README.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from moerl.config import RunConfig
from moerl.generation import (
    GenerateSpec,
    Generation,
    PromptRow,
    check_engine_memory,
    check_model,
    generate_config,
    prompt_row,
    run_generation,
    sampling_for,
)
from moerl.tasks import DatasetError

PromptLike = str | Sequence[Mapping[str, str]] | Mapping[str, object]
"""A prompt text, a chat conversation ``[{"role", "content"}, ...]``, or a row ``{"prompt" | "messages", "id"?}``."""

__all__ = ["Generation", "generate"]


def _rows(prompts: Sequence[PromptLike]) -> list[PromptRow]:
    """``PromptRow``s of the API's prompts; ids default to the position (from 0).

    Raises:
        ValueError: a prompt of another kind, a bad row (``moerl.generation.prompt_row``) or a duplicate id.
    """
    if isinstance(prompts, (str, Mapping)):
        raise ValueError("prompts must be a list (of texts, conversations or rows), not one prompt")
    rows, seen = [], set()
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            obj: object = {"prompt": p}
        elif isinstance(p, Mapping):
            obj = dict(p)
        elif isinstance(p, Sequence):
            obj = {"messages": list(p)}
        else:
            raise DatasetError(
                f"prompts[{i}]: a text, a list of messages or a row object, got {type(p).__name__}"
            )
        row = prompt_row(obj, str(i), f"prompts[{i}]")
        if row.id in seen:
            raise DatasetError(f"prompts[{i}]: duplicate id {row.id!r}")
        seen.add(row.id)
        rows.append(row)
    return rows


def generate(
    model: str | Path | None,
    prompts: Sequence[PromptLike],
    *,
    config: str | Path | RunConfig | None = None,
    overrides: Sequence[str] = (),
    n: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    tokenizer: str | Path | None = None,
    **rollout: object,
) -> list[Generation]:
    """Sample completions of ``prompts`` from ``model`` with the engine a run's rollout builds.

    The engine is ``moerl.runtime.build.make_engine`` over the config's ``rollout`` section (paged KV cache,
    ``max_slots`` sequences decoding together, ``kv_token_budget`` cache tokens, ``weight_dtype``,
    ``mla_cache``); chat conversations are rendered with the tokenizer's chat template as training renders
    them (``moerl.tasks.chat.chat_renderer``), plain texts as ``task.prompt_format`` says.

    Args:
        model: Hugging Face model folder; None: the config's ``model.path``.
        prompts: texts, conversations ``[{"role", "content"}, ...]`` (a trailing assistant message is
            dropped) or rows ``{"prompt": str} | {"messages": [...]}`` with an optional ``"id"``.
        config: a run config (YAML path or ``RunConfig``): its ``rollout`` (engine; sampling defaults,
            ``n`` = ``rollout.group_size``), ``task`` (prompt format, template, system prompt, tokenizer),
            ``seed``, ``model`` (path, dtype, device). None: the built-in defaults, greedy sampling.
        overrides: ``"section.field=value"`` strings applied to a YAML ``config`` (as ``--set``).
        n, max_new_tokens, temperature, top_p, top_k: sampling; None: the config's ``rollout`` values with a
            config, else greedy, 1 sample, up to 64 new tokens (fewer where a prompt leaves less context).
        seed: sampling seed; None: the config's ``seed``, else 0. Equal seeds give equal samples.
        dtype, device: the model's weights dtype (``float32``, ``bfloat16``) and torch device; None: the
            config's ``model.dtype`` / ``model.device`` (float32, cpu).
        tokenizer: tokenizer file or folder; None: ``task.tokenizer``, else the model folder's.
        **rollout: ``rollout.*`` fields to override, by name (``moerl.generation.ROLLOUT_FLAGS``: max_slots,
            kv_token_budget, kv_cache, kv_block_size, mla_cache, weight_dtype, ep_size, ep_dispatcher,
            ep_ranks_per_node).

    Returns:
        One ``Generation`` per sample, in prompt order then sample index: ``id``, ``sample_index``,
        ``prompt`` (text given to the model), ``prompt_ids`` [P], ``completion`` (text), ``token_ids`` [R],
        ``logprobs`` [R] (float32 behaviour log-probs log softmax(logits / T)[token], nats),
        ``finish_reason`` (``stop`` | ``length`` | ``error``), ``policy_version``, ``error``. A prompt the
        engine cannot serve (longer than the context or the cache) is one sample with ``finish_reason
        == "error"``; the others still run.

    Raises:
        ValueError: no prompts, a bad prompt or row, a bad config or setting (``ConfigError``, naming the
            field), a chat prompt and a tokenizer without a chat template, a bad model folder.
        FileNotFoundError: no such model folder, config or tokenizer.
        TypeError: an unknown ``rollout`` keyword.
    """
    rows = _rows(prompts)
    cfg = generate_config(config, overrides, **rollout)
    path = model if model is not None else cfg.model.path
    if path is None:
        raise ValueError("generate() needs a model folder (or a config with model.path)")
    check_model(
        str(path),
        str(tokenizer) if tokenizer is not None else cfg.task.tokenizer,
        cfg.rollout.ep_size,
        name="model",
    )
    seed = seed if seed is not None else (cfg.seed if config is not None else 0)
    cfg.seed = seed
    sampling = dict(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    params, fit_context = sampling_for(cfg, config is not None, seed=seed, **sampling)
    spec = GenerateSpec(
        model=str(path),
        cfg=cfg,
        params=params,
        fit_context=fit_context,
        tokenizer=str(tokenizer) if tokenizer is not None else cfg.task.tokenizer,
        dtype=dtype or cfg.model.dtype,
        device=device or cfg.model.device,
    )
    check_engine_memory(spec)
    return run_generation(spec, rows)
