"""KL estimators between the current policy and a reference policy, per token.

With tokens sampled from the current policy pi and the log-ratio ``x = log pi(y) - log pi_ref(y)``,
Schulman (2020), "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html), gives three
single-sample estimators of KL(pi || pi_ref), written there with ``r = pi_ref / pi = exp(-x)``:

- ``k1 = -log r = x``                          unbiased, high variance, can be negative;
- ``k2 = (log r)^2 / 2 = x^2 / 2``             biased, low variance, >= 0;
- ``k3 = (r - 1) - log r = exp(-x) - 1 + x``   unbiased, low variance, >= 0.

k3 is the estimator of GRPO (Shao et al. 2024, DeepSeekMath, eq. 4). It is computed as
``expm1(-x) + x``: ``exp(-x) - 1`` loses all digits for small x (float32 gives 0 or a negative value
at x = 1e-6), while ``expm1`` keeps them and, rounded to nearest, never falls below ``-x``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moerl.rl._checks import check_same_shape


def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


def _k3(x: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-x) + x


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""KL estimator name -> function of the log-ratio ``x = logp - ref_logp`` (Schulman 2020)."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    Args:
        logp: log pi(y_t) of the current policy, any shape, float; gradients flow through it.
        ref_logp: log pi_ref(y_t) of the reference policy, same shape (usually without grad).
        kind: ``"k1"`` (``x``), ``"k2"`` (``x^2 / 2``) or ``"k3"`` (``exp(-x) - 1 + x``) with
            ``x = logp - ref_logp``; Schulman (2020), "Approximating KL divergence".

    Returns:
        A tensor of the same shape and dtype as ``logp``, in nats. k2 and k3 are >= 0.
        Values at padding positions are whatever the inputs there give: mask them with
        ``torch.where`` (``aggregate`` does) before reducing.

    Raises:
        ValueError: unknown ``kind`` or shapes that differ.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind={kind!r} is not a KL estimator; choose one of {sorted(KL_ESTIMATORS)}")
    check_same_shape(logp=logp, ref_logp=ref_logp)
    return KL_ESTIMATORS[kind](logp - ref_logp)
