"""Count decoder-layer forwards that run inside the autograd backward pass: activation checkpointing's
recompute, and nothing else, happens there (a layer forward during backward is the recompute)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1  # private, but torch's own checkpoint code relies on it


@contextmanager
def layer_forwards(model: torch.nn.Module) -> Iterator[dict[str, Counter]]:
    """Count each of ``model.layers``' forwards while the block runs, split by where they ran:
    ``{"forward": Counter(layer index -> calls outside backward with grad enabled),
    "backward": Counter(layer index -> calls inside backward)}`` (no-grad forwards are not counted)."""
    counts = {"forward": Counter(), "backward": Counter()}

    def counted(index: int, forward):
        # wraps the instance's forward, not a forward hook: torch's checkpoint recompute skips module hooks
        def run(*args, **kwargs):
            if in_backward():
                counts["backward"][index] += 1
            elif torch.is_grad_enabled():
                counts["forward"][index] += 1
            return forward(*args, **kwargs)

        return run

    for i, layer in enumerate(model.layers):
        layer.forward = counted(i, layer.forward)
    try:
        yield counts
    finally:
        for layer in model.layers:
            del layer.forward  # the class's forward again
