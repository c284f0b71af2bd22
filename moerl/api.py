"""moerl from Python: the functions a notebook or a script calls instead of the ``moerl`` command.

    from moerl.api import generate, train

    summary = train("hf_parquet.yaml", trainer__steps=20, runtime__mode="sync")  # in examples/
    print(summary["final_eval_accuracy"], summary["policy"])
    samples = generate(summary["policy"], ["12+34=", [{"role": "user", "content": "Hi"}]], n=4, temperature=1.0)
    samples[0].completion, samples[0].logprobs

``train`` runs what ``moerl train`` runs; ``generate`` the engine and prompt rendering of ``moerl generate``
(``moerl.generation``; ``moerl/rollout/README.md``). Import from ``moerl.api``, not ``moerl``: ``moerl.train``
is a module (the run), so a function of that name on the package would be replaced by the submodule the
first time it is imported.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moerl.config import ConfigError, RunConfig, load_config, with_import_dirs
from moerl.configlib import from_dict, to_dict
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

__all__ = ["Generation", "generate", "nested_overrides", "resolve_config", "train"]


def nested_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Keyword overrides as a nested dict to merge into a config: ``trainer__steps=5`` (a double
    underscore between a section and its field, as ``--set trainer.steps=5``) becomes
    ``{"trainer": {"steps": 5}}``; a name without ``__`` is a top-level field (``seed=1``).

    Values are Python values (int, float, str, bool, None, list, dict), taken as they are: no YAML
    parsing, so ``name="007"`` stays a string.

    Raises:
        ConfigError: a name with an empty part (``trainer__``, ``__steps``).
    """
    nested: dict[str, Any] = {}
    for name, value in overrides.items():
        parts = name.split("__")
        if not all(parts):
            raise ConfigError(f"override {name}=...: write section__field, e.g. trainer__steps=5")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Deep-merge ``new`` into ``into`` in place (``new`` wins on a leaf; a dict given for a section is
    merged into it, as ``--set 'model={hidden_size: 32}'`` is)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def resolve_config(config: str | Path | dict | RunConfig | None, **overrides: Any) -> RunConfig:
    """The run config that ``train(config, **overrides)`` runs, validated, nothing started.

    Args:
        config: a YAML file (``str`` or ``Path``, read as ``moerl train --config`` reads it: the reward
            module is also looked for in the file's folder), a nested dict of the same shape as the YAML,
            a ``RunConfig`` (copied, never changed), or None for the built-in defaults.
        **overrides: ``section__field=value`` (see ``nested_overrides``).

    Raises:
        ConfigError: an unknown key (naming the closest valid one), a wrong type or an out-of-range value.
        FileNotFoundError: ``config`` names a file that does not exist.
        TypeError: ``config`` is none of the above.
    """
    path = None
    if config is None or isinstance(config, (str, Path)):
        path = None if config is None else Path(config)
        data = to_dict(load_config(path))
    elif isinstance(config, RunConfig):
        data = to_dict(config)
    elif isinstance(config, dict):
        data = copy.deepcopy(config)
    else:
        raise TypeError(f"config: a YAML path, a dict or a RunConfig, not {type(config).__name__}")
    _merge(data, nested_overrides(overrides))
    return with_import_dirs(from_dict(RunConfig, data), path)


def train(config: str | Path | dict | RunConfig | None = None, **overrides: Any) -> dict:
    """Run RL training as ``moerl train --config CONFIG --set section.field=value ...`` does, in this
    process, with the console's progress line; returns the run's summary.

    Example: ``train("hf_parquet.yaml", trainer__steps=5)`` is
    ``moerl train -c hf_parquet.yaml --set trainer.steps=5``.

    Args:
        config: a YAML path, a nested dict, a ``RunConfig`` or None (built-in defaults); see
            ``resolve_config``.
        **overrides: ``section__field=value``, e.g. ``trainer__steps=5``, ``runtime__mode="sync"``,
            ``seed=1``.

    Returns:
        The run's summary, the dict written to ``RUN_DIR/summary.json``: ``status`` (``"completed"``, or
        ``"stopped"`` with ``stop_reason``), ``steps``, ``start_eval_accuracy`` / ``final_eval_accuracy``
        (held-out exact match, 0..1, or None), ``wall_time_s`` (s), ``tasks_duplicated`` / ``tasks_lost``
        (0 in a sound run), ``policy`` (the exported Hugging Face folder, ``RUN_DIR/policy``: its parent
        is the run folder), ... (``moerl.train.Run.finish``).

    Raises:
        ConfigError: a bad config or override (one line, before any work starts).
        FileNotFoundError: a missing config, dataset or model folder.
        moerl.run.interrupt.RunInterrupted: Ctrl-C or SIGTERM during the run.
        moerl.errors.RewardFunctionError: the reward function failed (exit codes: docs/commands.md).
    """
    import moerl.train as run  # here: loads torch and the runtime

    return run.train(resolve_config(config, **overrides))


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
