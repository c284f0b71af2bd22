"""Load-time checks of the rollout engine's sizes (``RunConfig`` calls ``check_engine_sizes``).

The engine (``moerl.rollout.Engine``) gives each sequence a KV cache slot of
``min(rollout.kv_token_budget // rollout.max_slots, model context)`` tokens; a request whose prompt +
``rollout.max_new_tokens`` exceeds it can never run. What the config alone decides is checked here;
the prompts' own lengths are checked before the warm start (``moerl.run.preflight``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.configlib import ConfigError

if TYPE_CHECKING:  # type hints only: moerl.config imports this module
    from moerl.config import RunConfig


def model_context(cfg: RunConfig) -> int:
    """Longest sequence in tokens of the run's policy: ``max_position_embeddings`` of ``init_from``'s or
    ``model.path``'s config.json when the folder has one, else ``model.max_position_embeddings``."""
    for folder in (cfg.init_from, cfg.model.path):
        if folder is not None and (Path(folder) / "config.json").is_file():
            try:
                value = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
            except (OSError, ValueError, AttributeError):
                value = None  # the loader reports a broken folder with its own message
            return value if isinstance(value, int) and value > 0 else 4096  # moerl.models.hf_config's default
    return cfg.model.max_position_embeddings


def engine_slot_tokens(cfg: RunConfig) -> tuple[int, int]:
    """``(slot, context)``: the longest sequence one engine holds (a slot of ``rollout.kv_cache: slots``,
    the whole cache when ``paged``), as ``moerl.runtime.build.make_engine`` sizes it, and the model
    context that caps it."""
    context = model_context(cfg)
    r = cfg.rollout
    if r.kv_cache == "paged":  # one sequence may use the whole cache
        return min(r.kv_token_budget // r.kv_block_size * r.kv_block_size, context), context
    return min(r.kv_token_budget // r.max_slots, context), context


def check_engine_sizes(cfg: RunConfig) -> None:
    """The longest sequence an engine holds (a cache slot, or the whole paged cache) must hold a prompt of
    at least one token plus ``rollout.max_new_tokens``.

    Raises:
        ConfigError: naming ``rollout.kv_token_budget``, ``rollout.max_slots``,
            ``rollout.max_new_tokens`` and the model context, with their values.
    """
    r = cfg.rollout
    slot, context = engine_slot_tokens(cfg)
    cap = f"capped by the model context {context}: model.max_position_embeddings or the model folder's"
    if r.kv_cache == "paged":
        sizes = (
            f"(the whole cache: rollout.kv_token_budget={r.kv_token_budget} in blocks of "
            f"rollout.kv_block_size={r.kv_block_size}, {cap})"
        )
    else:
        sizes = f"(rollout.kv_token_budget={r.kv_token_budget} // rollout.max_slots={r.max_slots}, {cap})"
    what = "longest sequence" if r.kv_cache == "paged" else "cache slot"
    if slot < 2:
        raise ConfigError(
            f"the engine's {what} is {slot} tokens {sizes}; it must hold at least 2 (a prompt token "
            "and a new one): raise kv_token_budget" + ("" if r.kv_cache == "paged" else " or lower max_slots")
        )
    if r.max_new_tokens + 1 > slot:
        raise ConfigError(
            f"rollout.max_new_tokens={r.max_new_tokens} plus a prompt of at least 1 token cannot fit the "
            f"engine's {what} of {slot} tokens {sizes}; lower max_new_tokens or raise "
            + ("the model context (model.max_position_embeddings)" if slot == context else "kv_token_budget")
        )
