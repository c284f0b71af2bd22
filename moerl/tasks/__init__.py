"""Verifiable tasks, datasets, reward functions and tokenizers: where moerl's data flow starts.

Public API (contract in docs/architecture.md, "Tokenizer and tasks"):
- ``make_task(task_cfg, env_cfg=None) -> Task`` (the names: ``TASKS``): ``train_prompts(seed)``, ``eval_prompts()``, ``reward(...)``.
- ``Prompt(id, text, answer, solution=None)``, ``Reward(score, info)``.
- ``load_tokenizer(path_or_none) -> Tokenizer`` (``None``: the built-in character tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.tasks.arithmetic import ArithmeticTask
from moerl.tasks.base import Prompt, Reward, Task
from moerl.tasks.chat import ChatTemplateError, chat_renderer
from moerl.tasks.countdown import CountdownTask
from moerl.tasks.datasets import DatasetError, JsonlTask, eval_split, load_jsonl, load_records
from moerl.tasks.rewards import load_reward_fn, load_score_fn
from moerl.tasks.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config import EnvConfig, TaskConfig

__all__ = [
    "ArithmeticTask",
    "ChatTemplateError",
    "CountdownTask",
    "DatasetError",
    "JsonlTask",
    "Prompt",
    "Reward",
    "TASKS",
    "Task",
    "Tokenizer",
    "load_jsonl",
    "load_records",
    "load_reward_fn",
    "load_score_fn",
    "load_tokenizer",
    "make_task",
]


def _arithmetic(cfg: TaskConfig, env: EnvConfig | None, score_fn, template: dict) -> Task:
    return ArithmeticTask(
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        operations=cfg.operations,
        num_eval=cfg.num_eval,
        seed=cfg.seed,
        score_fn=score_fn,
        **template,
    )


def _countdown(cfg: TaskConfig, env: EnvConfig | None, score_fn, template: dict) -> Task:
    return CountdownTask(
        min_numbers=cfg.countdown_min_numbers,
        max_numbers=cfg.countdown_max_numbers,
        max_value=cfg.countdown_max_value,
        num_eval=cfg.num_eval,
        seed=cfg.seed,
        score_fn=score_fn,
        **template,
    )


def _dataset(cfg: TaskConfig, env: EnvConfig | None, score_fn, template: dict) -> Task:
    def read(path: str, split: str | None = None) -> list:
        return load_records(
            path,
            layout=cfg.layout,
            prompt_field=cfg.prompt_field,
            answer_field=cfg.answer_field,
            messages_field=cfg.messages_field,
            require_answer=score_fn is None,
            split=split,
        )

    eval_sets, source = _eval_sets(cfg, read)
    if "render" in template:  # chat: task.template (if any) shapes the user message, not the prompt
        template = {"render": template["render"]}
    return JsonlTask(
        read(cfg.path),
        name=Path(cfg.path).stem,
        num_eval=cfg.num_eval,
        score_fn=score_fn,
        eval_sets=eval_sets,
        eval_source=source,
        **template,
    )


def _eval_sets(cfg: TaskConfig, read: Callable[..., list]) -> tuple[dict[str, list] | None, str]:
    """The validation sets of a dataset task (name -> records) and what they are, for the split line:
    ``task.val_path`` (a DatasetDict folder gives its ``test``/``validation`` split), else the ``test`` or
    ``validation`` split of a DatasetDict ``task.path``, else None (carved from ``task.path``)."""
    named = cfg.val_sets()
    if named:
        sets = {}
        for name, path in named.items():
            split = eval_split(path)
            sets[name] = read(path, split)
        return sets, "task.val_path"
    split = eval_split(cfg.path)
    if split is None:
        return None, ""
    return {split: read(cfg.path, split)}, f"the {split!r} split of task.path={cfg.path}"


def _env(cfg: TaskConfig, env: EnvConfig | None, score_fn, template: dict) -> Task:
    if env is None:
        raise ValueError("task.name='env' needs the run's env section: make_task(cfg.task, cfg.env)")
    env_cls = load_reward_fn(
        env.import_path, what="env.name", dirs=cfg.import_dirs
    )  # the registry is the import path
    if not hasattr(env_cls, "make_task"):
        raise ValueError(f"env.name={env.name!r} is not an moerl.envs.Environment subclass (no make_task)")
    return env_cls.make_task(env, num_eval=cfg.num_eval, seed=cfg.seed)


TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": _arithmetic,
    "countdown": _countdown,
    "dataset": _dataset,
    "jsonl": _dataset,
    "env": _env,
}
"""The task registry: ``task.name`` -> its builder ``(task_cfg, env_cfg, score_fn, template) -> Task``
(``env``: an environment's tasks, ``moerl.envs``; ``dataset`` and its older name ``jsonl``: ``task.path``). The config's choice of task names is this table's keys."""


def make_task(cfg: TaskConfig, env: EnvConfig | None = None, tokenizer: Tokenizer | None = None) -> Task:
    """Build the task a ``TaskConfig`` describes (``cfg.template`` or the task's default template; with
    ``task.prompt_format=chat`` the ``tokenizer``'s chat template, ``moerl.tasks.chat``).

    ``task.name == "env"``: the environment class at ``env.import_path`` builds it
    (``Environment.make_task``, ``moerl.envs``); ``env`` is then required.

    Raises:
        ValueError: a task name not in ``TASKS``, a bad reward function path, or a reward function whose
            signature cannot take ``(prompt_text, response_text, answer)``.
        ImportError, AttributeError: ``cfg.reward_fn`` cannot be imported.
        FileNotFoundError, DatasetError: the dataset is missing or malformed.
        ChatTemplateError: ``prompt_format=chat`` without a tokenizer that has a chat template, or a template
            that does not render.
    """
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r}: choose one of {', '.join(TASKS)}")
    score_fn = None
    if cfg.reward_fn:
        score_fn = load_score_fn(
            cfg.reward_fn, dirs=cfg.import_dirs, batched=cfg.reward_batched, timeout_s=cfg.reward_timeout_s
        )
    template: dict = {"template": cfg.template} if cfg.template else {}
    if cfg.prompt_format == "chat":
        if tokenizer is None or tokenizer.chat_template is None:
            where = "no tokenizer given" if tokenizer is None else f"{tokenizer.source} has none"
            raise ChatTemplateError(f"task.prompt_format=chat needs the tokenizer's chat_template ({where})")
        template["render"] = chat_renderer(
            tokenizer.chat_template,
            tokenizer.special_tokens,
            system_prompt=cfg.system_prompt,
            user_template=cfg.template,
        )
    return TASKS[cfg.name](cfg, env, score_fn, template)
