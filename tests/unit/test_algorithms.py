"""LocalTrainer algorithms: mismatch correction from behaviour log-probs, KL to a reference, PPO's critic,
epochs and mini-batches, aux-loss-free balancing, the sequence balance loss, expert-load figures."""

import math
from dataclasses import replace

import pytest
import torch
from _tiny import tiny_model
from test_trainer import PAD, _groups, _model

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.models.moe import sequence_balance_loss, update_correction_bias
from moerl.rl import explained_variance, preset_from_config, rollout_mismatch_sums, whiten
from moerl.rl.mismatch import mismatch_weights
from moerl.trainer.batch import build_train_batch
from moerl.trainer.critic import gae_targets, with_value_head
from moerl.trainer.local import LocalTrainer
from moerl.trainer.reference import kl_penalized_group_advantages


def _trainer(model=None, algorithm=None, **cfg):
    cfg = {"lr": 1e-2, "micro_batch_size": 4, **cfg}
    return LocalTrainer(model or _model(), TrainerConfig(**cfg), algorithm or AlgorithmConfig())


def _on_policy_batch(trainer, offset=0.0):
    """The test batch with behaviour log-probs = the trainer's own, shifted by ``offset`` at the first row."""
    batch = build_train_batch(_groups(), pad_id=PAD)
    behav = trainer.no_grad_logprobs(batch) * batch.loss_mask
    behav[0] = torch.where(batch.loss_mask[0], behav[0] + offset, 0.0)
    return replace(batch, behaviour_logprobs=behav)


def test_default_mismatch_correction_uses_behaviour_logprobs_without_an_extra_forward():
    torch.manual_seed(0)
    trainer = _trainer(share_prompt=False)  # one pass per forward (a shared prompt is two)
    batch = _on_policy_batch(trainer, offset=-math.log(4.0))  # engine 4x less likely at row 0: rho = 4
    calls = []
    hook = trainer.model.register_forward_pre_hook(lambda *a: calls.append(1))
    stats = trainer.train_step(batch)
    hook.remove()
    assert len(calls) == 1  # one micro-batch, one training forward, no proximal recompute
    rows0 = int(batch.loss_mask[0].sum())
    total = batch.num_tokens
    a = stats.algo
    assert a.is_clipfrac == pytest.approx(rows0 / total, abs=1e-6)  # rho = 4 > C = 2 at row 0 only
    assert a.is_weight_mean == pytest.approx((2.0 * rows0 + (total - rows0)) / total, rel=1e-4)
    assert a.rollout_logprob_abs_diff == pytest.approx(math.log(4.0) * rows0 / total, rel=1e-4)
    x = -math.log(4.0)  # log behav - log train
    assert a.rollout_kl == pytest.approx((math.expm1(-x) + x) * rows0 / total, rel=1e-4)


def test_shared_prompt_forward_counts_two_passes_and_same_mismatch_figures():
    torch.manual_seed(0)
    trainer = _trainer()
    batch = _on_policy_batch(trainer, offset=-math.log(4.0))
    shared = trainer.train_step(batch).algo
    assert shared.is_clipfrac > 0 and shared.rollout_kl > 0


def test_mismatch_modes_hand_computed():
    mask = torch.tensor([[True, True, True, False]])
    old = torch.log(torch.tensor([[1.0, 3.0, 6.0, 1.0]]))
    behav = torch.zeros(1, 4)  # rho = 1, 3, 6 at the tokens
    old = torch.where(mask, old, 0.0)

    def w(**kw):
        return mismatch_weights(old, behav, mask, preset_from_config(AlgorithmConfig(**kw))).weights[0, :3]

    assert torch.allclose(w(), torch.tensor([1.0, 2.0, 2.0]))  # token TIS, C = 2
    assert torch.allclose(w(tis_mode="mask", tis_cap=4.0), torch.tensor([1.0, 3.0, 0.0]))  # MIS
    assert torch.allclose(w(tis_mode="icepop"), torch.tensor([1.0, 3.0, 0.0]))  # IcePop [0.5, 5]
    assert torch.allclose(w(tis_mode="icepop", tis_cap=2.5), torch.tensor([1.0, 0.0, 0.0]))
    geo = 18.0 ** (1 / 3)  # sequence level: geometric mean of 1, 3, 6 = 2.62
    assert torch.allclose(w(tis_level="sequence", tis_cap=10.0), torch.full((3,), geo))
    assert torch.allclose(w(tis_level="sequence"), torch.full((3,), 2.0))  # sequence TIS, C = 2
    assert torch.allclose(w(tis_mode="mask", tis_level="sequence"), torch.zeros(3))  # whole sequence out


def test_rollout_mismatch_sums_hand_computed():
    train = torch.tensor([[0.0, -1.0, -2.0]])
    behav = torch.tensor([[0.0, -1.5, -9.0]])
    mask = torch.tensor([[False, True, False]])
    sums = rollout_mismatch_sums(train, behav, mask)
    assert sums[0] == pytest.approx(0.5) and sums[1] == pytest.approx(math.expm1(0.5) - 0.5)


def test_kl_to_reference_starts_at_zero_and_rises():
    torch.manual_seed(0)
    trainer = _trainer(algorithm=AlgorithmConfig(kl_coef=0.01))
    batch = _on_policy_batch(trainer)
    kls = [trainer.train_step(batch).algo.kl_ref for _ in range(4)]
    assert kls[0] == 0.0 and kls[1] > 0 and kls[3] > kls[1]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_in_reward_penalizes_group_rewards(kind):
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[True, True], [True, False], [True, True], [False, False]])
    behav = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-1.0, -1.0], [0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [-1.0, 0.0], [-1.0, -1.0], [0.0, 0.0]])
    adv = kl_penalized_group_advantages(
        rewards, group_ids, behav, ref, mask, kl_coef=0.5, kl_kind=kind, estimator="dr_grpo"
    )
    x = -1.0  # row 1: behav - ref
    kl = {"k1": x, "k2": 0.5 * x * x, "k3": math.expm1(-x) + x}[kind]
    r1 = 1.0 - 0.5 * kl  # row 0 has no KL; dr_grpo: centered rewards
    assert adv.tolist() == pytest.approx([(1.0 - r1) / 2, (r1 - 1.0) / 2, 0.0, 0.0])


def test_kl_in_reward_trainer_step_runs_and_logs_kl_ref():
    torch.manual_seed(0)
    trainer = _trainer(algorithm=AlgorithmConfig(kl_coef=0.1, kl_in_reward=True, kl_kind="k2"))
    batch = _on_policy_batch(trainer)
    stats = [trainer.train_step(batch) for _ in range(3)]
    assert stats[0].algo.kl_ref == 0.0 and stats[2].algo.kl_ref > 0


def test_whiten_and_explained_variance_hand_computed():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    assert whiten(x, mask).tolist()[0] == pytest.approx([-1.0, 1.0, 0.0], abs=1e-6)
    returns = torch.tensor([[0.0, 2.0, 0.0]])
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.ones(1, 3), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[2.0, 0.0, 0.0]]), returns, mask) == pytest.approx(-3.0)


def test_gae_targets_with_zero_values_are_lambda_returns():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    adv, returns, _ = gae_targets(rewards, torch.zeros(2, 3), mask, AlgorithmConfig(preset="ppo"))
    assert returns.flatten().tolist() == pytest.approx(
        [0.0, 0.95, 1.0, 0.0, 0.0, 0.0]
    )  # lambda-returns, V = 0
    assert adv[mask].mean().abs() < 1e-6  # whitened


def test_ppo_critic_value_loss_falls_and_explained_variance_rises():
    torch.manual_seed(0)
    trainer = _trainer(algorithm=AlgorithmConfig(preset="ppo"), lr=1e-3, critic_lr=1e-2)
    assert trainer.algo.critic is not None
    batch = _on_policy_batch(trainer)
    stats = [trainer.train_step(batch).algo for _ in range(25)]
    assert stats[-1].value_loss < 0.5 * stats[0].value_loss
    assert stats[-1].value_explained_var > stats[1].value_explained_var
    state = trainer.state_dict()
    assert "critic" in state and set(state["critic"]) == {"model", "optimizer", "scheduler"}


def test_epochs_and_mini_batches_make_that_many_optimizer_steps_and_one_lr_step():
    torch.manual_seed(0)
    trainer = _trainer(ppo_epochs=2, mini_batches=2, recompute_proximal=True, warmup_steps=3)
    batch = _on_policy_batch(trainer)
    minis = batch.mini_batches(2)
    assert [m.num_tokens for m in minis] == [int(batch.loss_mask[:2].sum()), int(batch.loss_mask[2:].sum())]
    assert minis[1].task_ids == ("t1",) and minis[1].group_ids.tolist() == [0, 0]
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    stats = trainer.train_step(batch)
    assert len(steps) == 4 and trainer.scheduler.last_epoch == 1 and trainer.version == 1
    assert stats.algo.rollout_logprob_abs_diff < 1e-5  # proximal = behaviour here
    assert stats.ppo_kl != 0.0  # later updates moved away from the proximal policy


def test_update_correction_bias_moves_by_the_sign_of_the_load_error():
    bias = torch.zeros(4)
    update_correction_bias(bias, torch.tensor([5.0, 1.0, 2.0, 0.0]), 0.01)  # mean 2
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


def test_trainer_updates_deepseek_correction_bias_and_reports_load_ratio():
    torch.manual_seed(0)
    model = tiny_model(16, family="deepseek_v3", num_layers=2, max_position_embeddings=64)
    trainer = _trainer(model, bias_update_rate=0.001)
    batch = _on_policy_batch(trainer)
    before = [b.router.e_score_correction_bias.clone() for b in trainer.algo.bias_blocks]
    stats = trainer.train_step(batch)
    after = [b.router.e_score_correction_bias for b in trainer.algo.bias_blocks]
    assert before and all(((a - b).abs() <= 0.001 + 1e-9).all() for a, b in zip(after, before, strict=True))
    assert any((a != b).any() for a, b in zip(after, before, strict=True))
    assert len(stats.algo.expert_load_max_min_per_layer) == len(after)
    assert stats.algo.expert_load_max_min >= 1.0


def test_bias_update_needs_a_correction_bias():
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        _trainer(bias_update_rate=0.001)


def test_sequence_balance_loss_hand_computed():
    # 1 sequence of 2 tokens, E = 2, k = 1: balanced routing, uniform scores -> f = (1, 1), P = (.5, .5)
    logits = torch.zeros(2, 2)
    idx = torch.tensor([[0], [1]])
    assert float(sequence_balance_loss(logits, idx, None, 1)) == pytest.approx(1.0)
    # all tokens to expert 0 with p = (0.73, 0.27): f = (2, 0), P_0 = 0.731
    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    idx = torch.tensor([[0], [0]])
    p0 = math.exp(1) / (math.exp(1) + 1)
    assert float(sequence_balance_loss(logits, idx, None, 1)) == pytest.approx(2 * p0, rel=1e-5)
    # padding excluded; a padded second sequence with no token does not count
    mask = torch.tensor([True, True, False, False])
    two = sequence_balance_loss(torch.cat([logits, logits]), torch.cat([idx, idx]), mask, 2)
    assert float(two) == pytest.approx(2 * p0, rel=1e-5)


def test_sequence_level_aux_loss_trains():
    torch.manual_seed(0)
    trainer = _trainer(aux_loss_coef=0.01, aux_loss_level="sequence")
    assert all(b.aux_loss_level == "sequence" for b in trainer.model.moe_blocks())
    stats = trainer.train_step(_on_policy_batch(trainer))
    assert stats.aux_loss > 0 and not stats.is_skipped


def test_value_head_returns_a_tensor_of_its_own_like_a_linear_layer():
    """The value model's output owns its storage (a view would make FSDP2 warn on the sharded critic) and
    equals ``nn.Linear(H, 1)`` with the same weight and bias; the state dict keeps Linear's names."""
    torch.manual_seed(0)
    model = with_value_head(tiny_model(12))
    assert {k for k in model.state_dict() if k.startswith("lm_head.")} == {"lm_head.weight", "lm_head.bias"}
    assert not any(p.abs().sum() for p in model.lm_head.parameters())  # V = 0 at first
    with torch.no_grad():
        model.lm_head.weight.normal_()
        model.lm_head.bias.fill_(0.5)
    ids = torch.randint(1, 12, (3, 5))
    values = model(ids, torch.ones_like(ids)).logits
    assert values.shape == (3, 5, 1) and values.requires_grad and values._base is None
    h = torch.randn(3, 5, 16)
    linear = torch.nn.functional.linear(h, model.lm_head.weight, model.lm_head.bias)
    assert torch.allclose(model.lm_head(h), linear, atol=1e-6)
