"""Chat prompts: a tokenizer's ``chat_template`` (Jinja) rendered the way transformers renders it.

``apply_chat_template(..., tokenize=False, add_generation_prompt=True)`` of transformers compiles the
template in a sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter, ``raise_exception`` and ``strftime_now`` globals) and renders it with the
messages, ``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
``render_chat`` does the same, so that a prompt moerl trains on is the one transformers (and a serving
stack that uses the same template) would build. ``{% generation %}`` blocks are not supported.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a dataset's ``messages`` may use."""


class ChatTemplateError(ValueError):
    """A chat template that does not compile or raises while rendering (``raise_exception`` in it)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the tokenizer's chat_template does not compile: {e}") from None


def check_messages(messages: object, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (strings), else ``ValueError`` naming ``where``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"{where}: messages must be a non-empty list of {{role, content}}, got {type(messages).__name__}"
        )
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: message {i} is not a {{role: str, content: str}} object: {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render_chat(
    template: str, messages: list[dict[str, str]], special_tokens: dict[str, str] | None = None
) -> str:
    """The prompt string of ``messages`` under ``template`` with the generation prompt appended: what
    transformers' ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` returns.

    Args:
        template: the Jinja chat template (``tokenizer_config.json``'s ``chat_template``).
        messages: ``[{"role": ..., "content": ...}, ...]`` (``check_messages``).
        special_tokens: template variables such as ``{"bos_token": "<s>", "eos_token": "</s>"}``.

    Raises:
        ChatTemplateError: the template does not compile or raises for these messages.
    """
    import jinja2

    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=True, **(special_tokens or {})
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the tokenizer's chat_template failed to render: {e}") from None


PROMPT_FORMATS = ("raw", "chat")
"""How a dataset row becomes a prompt (``task.prompt_format``): ``raw`` fills ``task.template``; ``chat``
renders the row's messages (or its prompt as one user message) with the tokenizer's chat template."""


def chat_renderer(
    template: str, special_tokens: dict[str, str], *, system_prompt: str | None, user_template: str | None
):
    """A function ``record -> prompt text`` for ``moerl.tasks.datasets.JsonlTask(render=...)``: the record's
    ``messages`` (``messages`` layout) or one user message with its prompt (filled into ``user_template``
    when set), a ``system_prompt`` first unless the conversation has one, rendered by ``render_chat``."""

    def render(record) -> str:
        if record.messages is not None:
            messages = [dict(m) for m in record.messages]
        else:
            content = user_template.format(prompt=record.prompt) if user_template else record.prompt
            messages = [{"role": "user", "content": content}]
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return render_chat(template, messages, special_tokens)

    return render
