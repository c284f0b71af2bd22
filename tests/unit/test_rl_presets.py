"""Each preset against a direct float64 transcription of its paper's formula (values and gradients)."""

import dataclasses
import math

import pytest
import torch

from moerl.config import AlgorithmConfig, ConfigError
from moerl.rl import AGGREGATION_MODES, PRESETS, policy_loss, preset_from_config, resolve_preset
from moerl.rl.presets import ESTIMATORS, MISMATCH_MODES

B, T = 4, 6
LENGTHS = [6, 3, 1, 5]


def _inputs(log_ratio_scale: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = (old + log_ratio_scale * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    adv_seq = torch.randn(B, generator=gen, dtype=torch.float64)
    adv_tok = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = old - 0.2 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    mask = torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(1)
    return logp, old, adv_seq, adv_tok, ref, mask


def _clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def _ppo_term(logp, old, a, eps_low, eps_high):
    r = torch.exp(logp - old)
    return torch.minimum(r * a, _clip(r, 1 - eps_low, 1 + eps_high) * a)


def _grpo_paper(logp, old, adv, ref, beta):
    """DeepSeekMath eq. 3-4: 1/G sum_i 1/|o_i| sum_t {min(r A, clip(r) A) - beta D_KL}."""
    total = 0
    for i in range(B):
        seq = 0
        for t in range(LENGTHS[i]):
            ratio_ref = torch.exp(ref[i, t] - logp[i, t])  # pi_ref / pi_theta
            d_kl = ratio_ref - torch.log(ratio_ref) - 1
            seq = seq + _ppo_term(logp[i, t], old[i, t], adv[i], 0.2, 0.2) - beta * d_kl
        total = total + seq / LENGTHS[i]
    return -total / B


def _dr_grpo_paper(logp, old, adv, ref, beta):
    """Dr. GRPO: 1/G sum_i sum_t min(r A, clip(r) A) / MAX_TOKENS (here MAX_TOKENS = T)."""
    total = sum(
        _ppo_term(logp[i, t], old[i, t], adv[i], 0.2, 0.2) for i in range(B) for t in range(LENGTHS[i])
    )
    return -total / (B * T)


def _dapo_paper(logp, old, adv, ref, beta):
    """DAPO eq. 8: 1 / sum_i |o_i| * sum_i sum_t min(r A, clip(r, 1 - 0.2, 1 + 0.28) A)."""
    total = sum(
        _ppo_term(logp[i, t], old[i, t], adv[i], 0.2, 0.28) for i in range(B) for t in range(LENGTHS[i])
    )
    return -total / sum(LENGTHS)


def _gspo_paper(logp, old, adv, ref, beta):
    """GSPO: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|); 1/G sum_i min(s_i A_i, clip(s_i, 1-3e-4, 1+4e-4) A_i)."""
    total = 0
    for i in range(B):
        n = LENGTHS[i]
        s = torch.exp((logp[i, :n].sum() - old[i, :n].sum()) / n)
        total = total + torch.minimum(s * adv[i], _clip(s, 1 - 3e-4, 1 + 4e-4) * adv[i])
    return -total / B


def _cispo_paper(logp, old, adv, ref, beta):
    """MiniMax-M1 eq. 4-5: 1 / sum_i |o_i| * sum_i sum_t sg(clip(r, 1 - 1, 1 + 4)) A log pi."""
    total = 0
    for i in range(B):
        for t in range(LENGTHS[i]):
            r_hat = _clip(torch.exp(logp[i, t] - old[i, t]), 0.0, 5.0).detach()
            total = total + r_hat * adv[i, t] * logp[i, t]
    return -total / sum(LENGTHS)


def _ppo_paper(logp, old, adv, ref, beta):
    """PPO eq. 7: E_t[min(r_t A_t, clip(r_t, 1 - 0.2, 1 + 0.2) A_t)] over all tokens."""
    total = sum(
        _ppo_term(logp[i, t], old[i, t], adv[i, t], 0.2, 0.2) for i in range(B) for t in range(LENGTHS[i])
    )
    return -total / sum(LENGTHS)


# preset -> (transcription, log-ratio noise scale, per-token advantages?, KL beta)
CASES = {
    "grpo": (_grpo_paper, 0.3, False, 0.04),
    "dr_grpo": (_dr_grpo_paper, 0.3, False, 0.0),
    "dapo": (_dapo_paper, 0.3, False, 0.0),
    "gspo": (_gspo_paper, 1e-3, False, 0.0),
    "cispo": (_cispo_paper, 1.5, True, 0.0),
    "ppo": (_ppo_paper, 0.3, True, 0.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_preset_matches_paper_formula(name, seed):
    paper, scale, per_token, beta = CASES[name]
    logp, old, adv_seq, adv_tok, ref, mask = _inputs(scale, seed)
    adv = adv_tok if per_token else adv_seq
    kwargs = {"ref_logp": ref, "kl_coef": beta} if beta else {}
    # Padding holds garbage that must not matter.
    old_padded = torch.where(mask, old, float("nan"))
    loss, metrics = policy_loss(logp, old_padded, adv, mask, preset=name, norm_length=T, **kwargs)
    expected = paper(logp, old, adv, ref, beta)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (grad_expected,) = torch.autograd.grad(expected, logp)
    assert torch.allclose(grad, grad_expected, rtol=1e-8, atol=1e-12)
    # The inputs exercise the clip: some tokens are clipped, some are not.
    assert 0.0 < metrics["pg_clipfrac"] < 1.0


def test_behaviour_equal_to_old_changes_nothing():
    logp, old, adv_seq, _, _, mask = _inputs(0.3, 3)
    plain, _ = policy_loss(logp, old, adv_seq, mask, preset="dapo")
    corrected, metrics = policy_loss(logp, old, adv_seq, mask, preset="dapo", behav_logp=old)
    assert corrected.item() == plain.item()
    assert metrics["is_weight_mean"] == 1.0 and metrics["train_rollout_logprob_abs_diff"] == 0.0


def test_presets_are_frozen_data_with_overrides():
    assert set(PRESETS) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["grpo"].eps_high = 0.5
    dapo = resolve_preset("dapo", eps_high=0.3, dual_clip_c=None)
    assert (dapo.eps_low, dapo.eps_high, dapo.aggregation) == (0.2, 0.3, "token-mean")
    with pytest.raises(ValueError, match="unknown LossPreset field"):
        resolve_preset("dapo", eps_hi=0.3)
    with pytest.raises(ValueError, match="dual_clip_c=0.5 must be > 1"):
        resolve_preset("ppo", dual_clip_c=0.5)


def test_algorithm_config_resolves_preset():
    preset = preset_from_config(AlgorithmConfig(preset="dapo", tis_mode="mask", tis_cap=3.0))
    assert preset.eps_high == 0.28 and preset.dynamic_sampling
    assert (preset.mismatch_mode, preset.mismatch_cap) == ("mask", 3.0)
    assert preset_from_config(AlgorithmConfig(preset="grpo", dynamic_sampling=True)).dynamic_sampling
    with pytest.raises(ConfigError, match="algorithm.eps_low=1.5"):
        AlgorithmConfig(eps_low=1.5)
    with pytest.raises(ConfigError, match="algorithm.aggregation='mean'"):
        AlgorithmConfig(aggregation="mean")
    with pytest.raises(ConfigError, match="algorithm.dual_clip_c=1.0"):
        AlgorithmConfig(dual_clip_c=1.0)
    # The config's allowed values are the library's.
    for name, allowed in (
        ("aggregation", AGGREGATION_MODES),
        ("estimator", ESTIMATORS),
        ("tis_mode", MISMATCH_MODES),
    ):
        for value in allowed:
            AlgorithmConfig(**{name: value})
    assert math.isclose(AlgorithmConfig().gae_lambda, 0.95)
