"""The frozen reference policy of the KL penalty, and the KL folded into the reward.

``algorithm.kl_coef > 0`` adds ``beta * KL(pi_theta || pi_ref)`` to the objective (GRPO, Shao et al. 2024,
eq. 3; the estimators of ``moerl.rl.kl``). pi_ref is a frozen copy of the policy RL starts from (the warm
start or ``init_from``), taken when the trainer is built: a resumed run builds it from the same folder, so
it is the same reference. With ``algorithm.kl_in_reward`` the penalty moves into the reward instead
(Ziegler et al. 2019, Sec. 2): ``moerl.rl.token_rewards`` per token for GAE, or summed over the response
and subtracted from the sequence reward before the group advantages here.

Sharding: on a sharded trainer (``trainer.num_ranks > 1``) the reference is built sharded like the policy
(FSDP2 x EP, loaded from the same start folder: ``moerl.trainer.distributed.algo_models``) and handed over without
a copy; its no-grad forwards gather the shards like the policy's. Every function here is per-token math
on [B, T] tensors and needs no collective.

Shapes: B sequences, T tokens.
"""

from __future__ import annotations

import copy as _copy

import torch

from moerl.rl import group_advantages, kl_estimate


class ReferencePolicy:
    """A frozen, no-grad copy of a policy module.

    Args:
        policy: the policy at the start of RL (``moerl.models.MoeForCausalLM``); copied, never changed.
        copy: False: ``policy`` is already the reference's own model (a sharded one), frozen in place.
    """

    def __init__(self, policy: torch.nn.Module, *, copy: bool = True) -> None:
        self.model = (_copy.deepcopy(policy) if copy else policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)


def kl_penalized_group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    behav_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_kind: str,
    estimator: str,
) -> torch.Tensor:
    """Group advantages of ``r_i - beta * sum_t KL_t`` (the KL of sequence i's response tokens).

    ``KL_t = kl_estimate(behav_logp, ref_logp, kl_kind)``: the tokens were sampled by the behaviour
    policy, so its log-probs are the ones the penalty is measured with (as the per-token reward of
    Ziegler et al. 2019, Sec. 2, summed over the response).

    Args:
        rewards: [B] float32 sequence rewards. group_ids: [B] int64.
        behav_logp, ref_logp: [B, T] float32. mask: [B, T] bool, the response tokens.
        kl_coef: beta >= 0. kl_kind: k1, k2 or k3. estimator: grpo, dr_grpo or rloo.

    Returns:
        [B] float32 advantages (``moerl.rl.group_advantages``).
    """
    kl = torch.where(mask, kl_estimate(behav_logp.float(), ref_logp.float(), kl_kind), 0.0)
    return group_advantages(rewards - kl_coef * kl.sum(dim=1), group_ids, estimator=estimator)
