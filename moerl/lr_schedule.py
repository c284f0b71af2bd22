"""The learning-rate schedule of RL training and the SFT warm start: linear warm-up, then cosine decay.

SGDR (Loshchilov & Hutter 2017, eq. 5) with one cycle and eta_min = 0.1 x peak.
"""

from __future__ import annotations

import math


def warmup_cosine_lr(step: int, num_steps: int, warmup_steps: int, peak: float = 1.0) -> float:
    """The learning rate at optimizer step ``step`` (0-based).

    Linear warm-up ``peak * (step + 1) / warmup_steps`` over the first ``warmup_steps`` steps, then
    ``peak * (0.1 + 0.9 * (1 + cos(pi * p)) / 2)`` with ``p = (step - warmup_steps) / (num_steps -
    warmup_steps)`` capped at 1: the peak right after warm-up, ``0.1 * peak`` from ``num_steps`` on.
    With ``peak = 1`` it is the factor a ``torch.optim.lr_scheduler.LambdaLR`` multiplies the LR by.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
