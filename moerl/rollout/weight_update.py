"""What happens to sequences in flight when an engine switches to new weights (``rollout.on_weight_update``).

- ``continue``: nothing; later tokens attend over keys/values computed by the old weights, and every
  token carries the version of the weights that computed its logits (mixed per-token versions).
- ``recompute`` (``recompute_running``): the keys/values of every running sequence's prefix (prompt and
  the tokens generated so far but the last, which the next decode step feeds) are computed again under
  the new weights, as partial rollout's resume does with a fresh prefill. The next decode step then sees
  exactly the cache that a fresh prefill of the prefix under the new weights would have written, so the
  tokens after the update are those of a fresh prefill (greedy); tokens sampled before it keep their
  old version.
- ``abort`` (``cancel_all``): every request is dropped from the engine; the worker releases their leases
  (the tasks are requeued) and discards the tokens.

These run between ``Engine.step`` calls, never inside one. Shapes: R rows re-prefilled at once, T padded
prefix length.
"""

from __future__ import annotations

import torch

from moerl.rollout.engine import Engine
from moerl.rollout.params import Completion
from moerl.rollout.scheduler import Sequence

ON_WEIGHT_UPDATE = ("continue", "recompute", "abort")
"""The choices of ``rollout.on_weight_update``."""


@torch.no_grad()
def recompute_running(engine: Engine) -> list[Completion]:
    """Re-prefill the KV cache of every running sequence under the engine's current weights.

    Tokens sampled but not yet copied to the host are synced first; sequences that this sync finishes
    are returned as completions (the caller handles them as it would ``step()``'s).

    Returns:
        Completions finished by the sync (empty when nothing was pending).
    """
    done = engine._sync() if engine.host else []
    for chunk in recompute_chunks(engine):
        reprefill(engine, chunk)
    return done


def recompute_chunks(engine: Engine) -> list[list[Sequence]]:
    """The running sequences, in scheduler order, cut into re-prefill forwards of at most
    ``max_prefill_tokens`` prefix tokens each (a longer prefix gets a forward of its own). An EP group
    runs them in lockstep (``moerl.rollout.ep_group``), so the plan is separate from the forwards."""
    budget = engine.scheduler.max_prefill_tokens
    chunks: list[list[Sequence]] = []
    tokens = 0
    for seq in engine.scheduler.running:
        n = seq.seq_len - 1
        if not chunks or tokens + n > budget:
            chunks.append([])
            tokens = 0
        chunks[-1].append(seq)
        tokens += n
    return chunks


def reprefill(engine: Engine, seqs: list[Sequence]) -> None:
    """One prefill forward of the prefixes of ``seqs`` into their own cache; logits are discarded."""
    engine._reprefill(seqs)


def cancel_all(engine: Engine) -> int:
    """Drop every waiting and running request from the engine (tokens not yet synced are discarded).

    Returns:
        Running sequences dropped.
    """
    engine.host.clear()
    running = list(engine.scheduler.running)
    for seq in running:
        seq.finish_reason = "abort"
    engine._release(running)
    engine._drop_waiting()
    return len(running)
