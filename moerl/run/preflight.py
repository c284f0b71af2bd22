"""Checks of a run's inputs that need more than its config: run before the warm start (``moerl.train``,
``moerl sft``), so that a bad import path, dataset or prompt length is a one-line ``ConfigError`` and not
a traceback after minutes of SFT.

What the config alone decides (types, ranges, engine sizes) is checked when it loads (``moerl.config``);
this module imports the user's code (``task.reward_fn``, ``env.name``), reads the dataset
(``task.path``) and tokenizes the prompts, as the warm start would, and checks that the rollout engines'
KV caches and the policy fit the memory of the device they are built on (``moerl.rollout.memory_check``:
run here, where the engines are built, not when a config loads, so that ``moerl cluster render`` never
measures a cluster run against the laptop it runs on).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from moerl.config import ConfigError, RunConfig, engine_slot_tokens
from moerl.models import CheckpointError, MoeConfig, check_model_folder
from moerl.models.reward_model import check_reward_folder
from moerl.placement import Placement
from moerl.rollout.memory_check import check_memory
from moerl.tasks import (
    ChatTemplateError,
    DatasetError,
    Task,
    Tokenizer,
    load_reward_fn,
    load_score_fn,
    make_task,
)
from moerl.tasks.tokenizer import load_run_tokenizer, load_tokenizer, run_tokenizer_path

NUM_TRAIN_PROMPTS_CHECKED = 256
"""Training prompts whose token length is checked (besides every held-out prompt)."""

_IMPORT_ERRORS = (ImportError, AttributeError, ValueError, SyntaxError)
"""What importing ``package.module:attr`` raises for a bad path (``load_reward_fn``) or a broken module."""


def check_run_inputs(cfg: RunConfig, *, rollouts: bool = True) -> Task:
    """Import ``task.reward_fn`` (and check its signature) and ``env.name``, build the task (reading
    ``task.path``), check that its prompts plus ``rollout.max_new_tokens`` fit an engine cache slot and
    that the engines and the policy fit the device's memory (``check_memory``). Returns the task.

    Args:
        cfg: the run config.
        rollouts: count the rollout workers' engines in the memory estimate (False for ``moerl sft``,
            which builds only its eval engine).
    Raises:
        ConfigError: naming the field: a ``trainer.batch_groups`` above the task's distinct training prompts
            (``Task.max_train_prompts``), ``model.device=meta`` (no weights to train), ``runtime.mode=async``
            where Ray does not import, an ``init_from`` or
            ``model.path`` folder that ``check_policy_folders`` refuses, an import path that does not
            import or is not callable, a reward
            function that cannot take ``(prompt_text, response_text, answer)``, a malformed dataset
            (``file:line:`` and what is wrong), a task the config cannot build, a task with no held-out
            prompts, a prompt too long for a cache slot, or engine sizes beyond the device's memory.
    """
    if cfg.model.device == "meta":
        raise ConfigError("model.device=meta holds shapes only, no weights: a run needs cpu, cuda or cuda:N")
    placement = Placement.from_config(cfg)
    if rollouts and placement.uses_ray:
        try:  # imported now, not when the workers start after the warm start: a missing or broken Ray
            import ray  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "runtime.mode=async runs its rollout workers as Ray actors, and Ray does not import in this "
                f"Python ({e}): pip install 'ray>=2.30', or runtime.mode=sync"
            ) from None
    check_policy_folders(cfg)
    if cfg.task.reward_fn:
        _check_import("task.reward_fn", cfg.task.reward_fn, load_score_fn, cfg.task.import_dirs)
    if cfg.task.name == "env":
        _check_import("env.name", cfg.env.import_path, load_reward_fn, cfg.task.import_dirs)
    tokenizer = load_run_tokenizer(cfg, cfg.init_from)
    check_vocabulary(cfg, tokenizer)
    check_reward_model(cfg, tokenizer.vocab_size)
    check_memory(cfg, placement, tokenizer.vocab_size, rollouts=rollouts)  # before any dataset is read
    try:
        task = make_task(cfg.task, cfg.env, tokenizer)
    except FileNotFoundError as e:
        raise ConfigError(f"task.path={cfg.task.path!r}: no such file or folder ({e})") from None
    except ChatTemplateError as e:
        raise ConfigError(str(e)) from None
    except DatasetError as e:  # the message starts with <file>:<line>:
        raise ConfigError(f"task.path: {e}") from None
    except _IMPORT_ERRORS as e:  # an environment's own make_task refusing the env: section
        raise ConfigError(f"task.name={cfg.task.name!r}: {e}") from None
    if cfg.task.name != "env":  # episodes grow turn by turn; their engines check each turn's request
        _check_prompt_length(cfg, task, tokenizer)
    supply = task.max_train_prompts
    if rollouts and supply is not None and cfg.trainer.batch_groups > supply:
        raise ConfigError(
            f"trainer.batch_groups={cfg.trainer.batch_groups} can never fill with distinct prompts: the task has "
            f"at most {supply} training prompts (task.name={cfg.task.name!r}); lower trainer.batch_groups"
        )
    if hasattr(task, "split_line"):  # a dataset that passed: its split, in the first lines of the run
        print(f"moerl: task.path={cfg.task.path!r}: {task.split_line()}", file=sys.stderr)
    return task


def check_vocabulary(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """The tokenizer's ids must all be rows of the policy's embedding: its ``vocab_size`` (added tokens
    included) at most the model's (``config.json`` of ``init_from`` or ``model.path``; ``model.*`` builds a
    fresh model of the tokenizer's size). A model with more rows than the tokenizer has ids is fine.

    Raises:
        ConfigError: naming the tokenizer, the folder and both sizes.
    """
    folder = cfg.init_from or cfg.model.path
    if folder is None or "://" in folder or not (Path(folder) / "config.json").is_file():
        return
    try:
        model_vocab = MoeConfig.from_hf_dict(
            json.loads((Path(folder) / "config.json").read_text())
        ).vocab_size
    except (ValueError, KeyError, TypeError, OSError):
        return  # check_policy_folders names what is wrong with the folder
    if tokenizer.vocab_size > model_vocab:
        field = "init_from" if cfg.init_from else "model.path"
        raise ConfigError(
            f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size} token ids but {field}={folder!r} has "
            f"vocab_size={model_vocab}: ids >= {model_vocab} would index past the embedding; use the model's "
            "own tokenizer (task.tokenizer)"
        )


def check_reward_model(cfg: RunConfig, vocab_size: int) -> None:
    """Check ``reward.model_path`` (when set) with ``check_reward_folder``: a folder whose architecture
    moerl runs, readable weights, and a vocabulary that holds the policy tokenizer's ids (the reward
    model scores the policy's token ids). A URL is left to the code that reads it.

    Raises:
        ConfigError: one line naming ``reward.model_path`` and what is wrong.
    """
    folder = cfg.reward.model_path
    if folder is None or "://" in folder:
        return
    try:
        rm, _ = check_reward_folder(folder)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"reward.model_path={folder!r}: {e}") from None
    if rm.vocab_size < vocab_size:
        raise ConfigError(
            f"reward.model_path={folder!r}: vocab_size={rm.vocab_size} is smaller than the policy tokenizer's "
            f"{vocab_size}; the reward model scores the policy's token ids, so it must share its tokenizer"
        )


def check_policy_folders(cfg: RunConfig) -> None:
    """Check the local model folders a run reads (``init_from``, ``model.path``) with
    ``moerl.models.check_model_folder`` (config.json parses and names a supported architecture, every
    safetensors header reads; no tensor is loaded), and the tokenizer the run takes for the folder it
    starts from: without ``task.tokenizer`` and without a ``tokenizer.json`` in that folder, the run uses
    the built-in character tokenizer (``moerl.tasks.tokenizer.run_tokenizer_path``), which is said in one
    line on stderr, or refused when its vocabulary is not the model's ``vocab_size`` (then the folder's
    model was not trained with it). A URL (``s3://...``) is left to the code that fetches it.

    Raises:
        ConfigError: naming the field and the file: no config.json, a config.json that is not JSON or
            names no supported architecture, a truncated or unreadable safetensors file, or a folder
            without tokenizer.json whose ``vocab_size`` is not the built-in tokenizer's.
    """
    for field, folder in (("init_from", cfg.init_from), ("model.path", cfg.model.path)):
        if folder is None or "://" in folder:
            continue
        if not (Path(folder) / "config.json").is_file():
            raise ConfigError(f"{field}={folder!r} is not a Hugging Face model folder (no config.json)")
        try:
            hf = check_model_folder(folder)
        except (FileNotFoundError, CheckpointError) as e:
            raise ConfigError(f"{field}={folder!r}: {e}") from None
        if folder == (cfg.init_from or cfg.model.path):  # the folder the run's tokenizer is taken from
            _check_builtin_tokenizer(cfg, field, folder, hf)


def _check_builtin_tokenizer(cfg: RunConfig, field: str, folder: str, hf: MoeConfig) -> None:
    if run_tokenizer_path(cfg, cfg.init_from) is not None:  # task.tokenizer, or the folder's own
        return
    vocab = load_tokenizer(None).vocab_size
    if hf.vocab_size != vocab:
        raise ConfigError(
            f"{field}={folder!r} has no tokenizer.json, and the built-in character tokenizer the run would "
            f"use instead has {vocab} tokens, not the model's vocab_size={hf.vocab_size}: put the model's "
            "tokenizer.json in the folder or set task.tokenizer=PATH"
        )
    print(
        f"moerl: {field}={folder!r} has no tokenizer.json: the run uses the built-in character tokenizer "
        f"({vocab} tokens, the model's vocab_size); set task.tokenizer=PATH for another",
        file=sys.stderr,
    )


def _check_import(field: str, spec: str, load, dirs=()) -> None:
    try:
        load(spec, what=field, dirs=dirs)
    except _IMPORT_ERRORS as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _check_prompt_length(cfg: RunConfig, task: Task, tokenizer: Tokenizer) -> None:
    """The longest held-out prompt (of every validation set, and of the first training prompts) +
    ``max_new_tokens`` must fit the cache slot (``moerl.config.engine_slot_tokens``), else every request of
    it fails in the engine."""
    held_out = [p for prompts in task.eval_sets().values() for p in prompts]
    if not held_out:  # a dataset holds out at most half its rows: one row leaves none to evaluate
        raise ConfigError(
            f"task: no held-out prompts (task.name={cfg.task.name!r}, task.num_eval={cfg.task.num_eval}): "
            "the dataset is too small to hold any out for eval"
        )
    train = list(itertools.islice(task.train_prompts(cfg.task.seed + cfg.seed), NUM_TRAIN_PROMPTS_CHECKED))
    prompts = held_out + train
    longest = max(prompts, key=lambda p: len(tokenizer.encode(p.text)))
    num_tokens = len(tokenizer.encode(longest.text))
    slot, context = engine_slot_tokens(cfg)
    r = cfg.rollout
    if num_tokens + r.max_new_tokens > slot:
        if Placement.from_config(cfg).rollout.cache_kind == "paged":
            sizes = (
                f"longest sequence of {slot} tokens (the whole cache: rollout.kv_token_budget={r.kv_token_budget} "
                f"in blocks of rollout.kv_block_size={r.kv_block_size}"
            )
        else:
            sizes = (
                f"cache slot of {slot} tokens (rollout.kv_token_budget={r.kv_token_budget} // "
                f"rollout.max_slots={r.max_slots}"
            )
        raise ConfigError(
            f"rollout.max_new_tokens={r.max_new_tokens} plus the task's longest prompt ({num_tokens} tokens: "
            f"{longest.text[:40]!r}) cannot fit the engine's {sizes}, capped by the model "
            f"context {context}); lower max_new_tokens or raise kv_token_budget"
        )
