"""The policy-gradient surrogates by name: the one table ``LossPreset.surrogate`` is checked against and
``policy_loss`` calls.

Each surrogate maps ``(ratio, clipped, adv, logp, preset)``, all [B, T] float tensors per token except
``preset`` (r = pi_theta / pi_old, its clipped value, the advantage A, log pi_theta), to ``(loss, high,
low)``: the per-token loss before aggregation [B, T] and the bool flags of tokens clipped from above and
from below [B, T].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # moerl.rl.presets validates its surrogate against SURROGATES below
    from moerl.rl.presets import LossPreset

Surrogate = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(per-token loss, clipped-high flag, clipped-low flag) from (ratio, clipped ratio, A, logp, preset)."""


def _ppo_clip(ratio, clipped, adv, logp, preset: LossPreset):
    del logp
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    if preset.dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -preset.dual_clip_c * adv), loss)
    high = (adv > 0) & (ratio > 1.0 + preset.eps_high)
    low = (adv < 0) & (ratio < 1.0 - preset.eps_low)
    return loss, high, low


def _cispo(ratio, clipped, adv, logp, preset: LossPreset):
    loss = -clipped.detach() * adv * logp
    return loss, ratio > 1.0 + preset.eps_high, ratio < 1.0 - preset.eps_low


SURROGATES: dict[str, Surrogate] = {"ppo_clip": _ppo_clip, "cispo": _cispo}
"""``LossPreset.surrogate`` -> function giving the per-token surrogate loss and clip flags: ``ppo_clip``
-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), capped at -c A where A < 0 with dual clip (Schulman et
al. 2017, eq. 7; Ye et al. 2020, Sec. 3.3); ``cispo`` -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi
(MiniMax-M1 2025, eq. 4-5)."""
