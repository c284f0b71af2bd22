"""LocalTrainer: batch building, micro-batch equivalence, NaN skipping, expert load CV, state round trip."""

import math

import pytest
import torch
from _recompute import layer_forwards
from _tiny import tiny_model

from moerl.config import AlgorithmConfig, ConfigError, TrainerConfig
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.rl import entropy_from_logits
from moerl.trainer.batch import build_train_batch
from moerl.trainer.checkpoint import load_checkpoint
from moerl.trainer.local import LocalTrainer, NonFiniteLossError, expert_load_cv

VOCAB = 16
PAD = 0


def _model():
    return tiny_model(VOCAB, max_position_embeddings=64)


def _group(task_id, prompt, responses, rewards, token=1, version=0):
    task = RolloutTask(
        task_id=task_id, prompt_ids=prompt, prompt_text="p", answer="a", num_samples=len(responses)
    )
    samples = [
        Sample(
            prompt_ids=prompt,
            response_ids=r,
            response_logprobs=[-1.0 - 0.1 * i for i in range(len(r))],
            loss_mask=[1] * len(r),
            finish_reason="stop",
            policy_versions=[version] * len(r),
            reward=w,
        )
        for r, w in zip(responses, rewards, strict=True)
    ]
    return Group.from_lease(Lease(task, "w", token, 0.0), samples, 0.5)


def _groups():
    return [
        _group("t0", [3, 4], [[5, 6, 7], [8]], [1.0, 0.0]),
        _group("t1", [9], [[10, 11], [12, 13, 14, 15]], [0.0, 0.0], token=2, version=1),
    ]


def _reference_padding(groups, pad_id):
    """The straightforward row-by-row construction that ``build_train_batch`` vectorizes."""
    samples = [s for g in groups for s in g.samples]
    length = max(max(len(s.prompt_ids) + len(s.response_ids) for s in samples), 2)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.int64)
    attn = torch.zeros(len(samples), length, dtype=torch.int64)
    loss = torch.zeros(len(samples), length, dtype=torch.bool)
    behav = torch.zeros(len(samples), length, dtype=torch.float32)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[row, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        attn[row, : p + r] = 1
        for j in range(r):
            loss[row, p + j] = bool(s.loss_mask[j])
            behav[row, p + j] = s.response_logprobs[j]
    return ids, attn, loss, behav


def test_build_train_batch_matches_row_by_row_padding_on_ragged_groups():
    gen = torch.Generator().manual_seed(3)

    def rand_list(n, high):
        return torch.randint(1, high, (n,), generator=gen).tolist()

    groups = []
    for g in range(5):
        prompt = rand_list(int(torch.randint(1, 6, (1,), generator=gen)), VOCAB)
        samples = []
        for i in range(2 + g % 3):
            response = rand_list(int(torch.randint(0, 7, (1,), generator=gen)), VOCAB)
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=response,
                    response_logprobs=[-0.37 * (j + 1) - g for j in range(len(response))],
                    loss_mask=[x - 1 for x in rand_list(len(response), 3)],  # ragged 0/1 masks
                    finish_reason="stop",
                    policy_versions=[g] * len(response),
                    reward=float(i % 2),
                )
            )
        task = RolloutTask(
            task_id=f"t{g}", prompt_ids=prompt, prompt_text="p", answer="a", num_samples=len(samples)
        )
        groups.append(Group.from_lease(Lease(task, "w", g, 0.0), samples, 0.5))
    batch = build_train_batch(groups, pad_id=PAD)
    ids, attn, loss, behav = _reference_padding(groups, PAD)
    assert torch.equal(batch.input_ids, ids)
    assert torch.equal(batch.attention_mask, attn)
    assert torch.equal(batch.loss_mask, loss & (attn == 1))
    assert torch.equal(batch.behaviour_logprobs, behav)
    sizes = [len(g.samples) for g in groups]
    assert batch.group_ids.tolist() == [g for g, n in enumerate(sizes) for _ in range(n)]
    assert batch.num_tokens == int(loss.sum()) and batch.num_seqs == int(loss.any(1).sum())


def test_build_train_batch_pads_masks_and_normalizers():
    batch = build_train_batch(_groups(), pad_id=PAD)
    assert batch.input_ids.shape == (4, 5)
    assert batch.input_ids[0].tolist() == [3, 4, 5, 6, 7]
    assert batch.input_ids[1].tolist() == [3, 4, 8, PAD, PAD]
    assert batch.attention_mask[3].tolist() == [1, 1, 1, 1, 1]
    assert batch.loss_mask[1].tolist() == [False, False, True, False, False]
    assert batch.behaviour_logprobs[0].tolist() == pytest.approx([0, 0, -1.0, -1.1, -1.2])
    # GRPO: group t0 rewards (1, 0): mean 0.5, unbiased std 1/sqrt(2) -> +-0.7071; t1 all equal -> 0
    assert batch.advantages.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0], abs=1e-5)
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.policy_versions.tolist() == [0, 0, 1, 1]
    assert (batch.num_tokens, batch.num_seqs) == (3 + 1 + 2 + 4, 4)
    assert batch.task_ids == ("t0", "t1") and batch.lease_tokens == (1, 2) and batch.group_versions == (0, 1)
    micro = list(batch.micro_batches(2))
    assert [m.input_ids.shape for m in micro] == [(2, 5), (2, 5)]
    assert micro[0].num_tokens == batch.num_tokens  # global normalizer kept
    short = list(build_train_batch(_groups()[1:], pad_id=PAD).micro_batches(1))
    assert short[0].input_ids.shape == (1, 3)  # cut to its own longest sequence
    with pytest.raises(ValueError, match="no groups"):
        build_train_batch([], pad_id=PAD)


def test_expert_load_cv_hand_computed():
    balanced = torch.tensor([[0], [1], [0], [1]]).reshape(1, 4, 1, 1)
    assert expert_load_cv(balanced, torch.ones(1, 4), 2) == pytest.approx(0.0)
    skewed = torch.tensor([0, 0, 0, 1]).reshape(1, 4, 1, 1)  # counts (3, 1): mean 2, std 1
    assert expert_load_cv(skewed, torch.ones(1, 4), 2) == pytest.approx(0.5)
    masked = torch.tensor([0, 0, 0, 1]).reshape(1, 4, 1, 1)
    assert expert_load_cv(masked, torch.tensor([[1, 0, 0, 1]]), 2) == pytest.approx(0.0)


def _trainer(model, **kw):
    cfg = TrainerConfig(**{"lr": 1e-2, "micro_batch_size": 4, "grad_clip": 0.0, **kw})
    return LocalTrainer(model, cfg, AlgorithmConfig(preset="grpo"), temperature=1.0)


def _behaviour_from(model, batch):
    """Set the behaviour log-probs to the model's own (on-policy), as the engine would report them."""
    trainer = _trainer(model)
    return trainer._proximal_logprobs(batch)[0] * batch.loss_mask


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    torch.manual_seed(0)
    base = _model()
    batch = build_train_batch(_groups(), pad_id=PAD)
    results = []
    for size in (4, 1):
        model = _model()
        model.load_state_dict(base.state_dict())
        trainer = _trainer(model, micro_batch_size=size, lr=1e-3)
        stats = trainer.train_step(batch)
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}))
    (s4, w4), (s1, w1) = results
    assert s4.grad_norm == pytest.approx(s1.grad_norm, rel=1e-4)
    assert s4.pg_loss == pytest.approx(s1.pg_loss, rel=1e-4, abs=1e-6)
    for k in w4:
        torch.testing.assert_close(w4[k], w1[k], rtol=1e-5, atol=1e-6)


def test_step_raises_logprob_of_positive_advantage_and_reports_metrics():
    torch.manual_seed(0)
    model = _model()
    batch = build_train_batch(_groups(), pad_id=PAD)
    from dataclasses import replace

    batch = replace(batch, behaviour_logprobs=_behaviour_from(model, batch))
    trainer = _trainer(model, recompute_proximal=True, aux_loss_coef=0.01)
    before = trainer._proximal_logprobs(batch)[0]
    stats = trainer.train_step(batch)
    after = trainer._proximal_logprobs(batch)[0]
    good = batch.loss_mask[0]
    bad = batch.loss_mask[1]
    assert after[0][good].sum() > before[0][good].sum()  # A > 0: more likely
    assert after[1][bad].sum() < before[1][bad].sum()  # A < 0: less likely
    assert stats.step == 1 and trainer.version == 1 and not stats.is_skipped
    assert abs(stats.ppo_kl) < 1e-5  # proximal = current before the update
    assert stats.grad_norm > 0 and stats.entropy > 0 and stats.aux_loss > 0
    assert stats.expert_load_cv >= 0 and stats.num_tokens == int(batch.attention_mask.sum())


def test_nan_loss_is_skipped_counted_and_stops_after_max_in_a_row():
    model = _model()
    batch = build_train_batch(_groups(), pad_id=PAD)
    trainer = _trainer(model, max_nan_steps=2)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    stats = trainer.train_step(batch)
    assert stats.is_skipped and math.isnan(stats.grad_norm) and trainer.num_skipped == 1
    assert torch.equal(model.embed_tokens.weight, good["embed_tokens.weight"])  # no update applied
    with pytest.raises(NonFiniteLossError, match="2 trainer steps in a row"):
        trainer.train_step(batch)
    with torch.no_grad():  # a finite step resets the streak
        model.lm_head.weight.copy_(good["lm_head.weight"])
    trainer.nan_streak = 1
    assert not trainer.train_step(batch).is_skipped and trainer.nan_streak == 0


def test_state_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = _model()
    batch = build_train_batch(_groups(), pad_id=PAD)
    trainer = _trainer(model, warmup_steps=4)
    trainer.train_step(batch)
    path = trainer.checkpoint(tmp_path, {"controller": {"samples": 4}})
    parts = load_checkpoint(path)
    assert parts["controller"] == {"samples": 4} and path.name == "step_1"
    clone = _trainer(_model(), warmup_steps=4)
    clone.load_state_dict(parts)
    assert (
        clone.step == 1 and clone.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]
    )
    s1, s2 = trainer.train_step(batch), clone.train_step(batch)
    assert s1.grad_norm == s2.grad_norm and s1.lr == pytest.approx(0.01 * 2 / 4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, clone.model.state_dict()[k])


def test_ppo_builds_a_critic_and_kl_coef_a_frozen_reference():
    ppo = LocalTrainer(_model(), TrainerConfig(), AlgorithmConfig(preset="ppo"))
    assert ppo.algo.critic is not None and ppo.algo.reference is None
    kl = LocalTrainer(_model(), TrainerConfig(), AlgorithmConfig(kl_coef=0.1))
    assert kl.algo.reference is not None and kl.algo.critic is None
    assert not any(p.requires_grad for p in kl.algo.reference.model.parameters())


@pytest.mark.parametrize("background", [False, True])
def test_a_crash_while_saving_never_exposes_a_partial_checkpoint_or_weight_version(
    tmp_path, monkeypatch, background
):
    import moerl.trainer.checkpoint as ckpt_mod
    from moerl.trainer.checkpoint import latest_checkpoint
    from moerl.weights.store import WeightStore

    trainer = _trainer(_model(), background_publish=background)
    store = WeightStore(str(tmp_path / "weights"))
    assert trainer.publish(store).version == 0  # a trainer's first publish is never in the background
    trainer.checkpoint(tmp_path, {})
    trainer.train_step(build_train_batch(_groups(), pad_id=PAD))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store, "_write_manifest", crash)
    if background:  # the write fails on the writer thread; the store's next flush or read raises it
        assert trainer.publish(store) is None
        with pytest.raises(OSError, match="disk full"):
            store.flush()
    else:
        with pytest.raises(OSError, match="disk full"):
            trainer.publish(store)
    assert store.versions() == [0] and store.latest().version == 0
    monkeypatch.setattr(ckpt_mod, "_write_part", crash)
    with pytest.raises(OSError, match="disk full"):
        trainer.checkpoint(tmp_path, {})
    assert latest_checkpoint(tmp_path).name == "step_0"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0"]


def test_lr_schedule_warmup_constant_and_cosine_hand_values():
    from moerl.trainer.local import lr_factor

    const = TrainerConfig(steps=100, warmup_steps=10)
    assert [lr_factor(const, s) for s in (0, 4, 9, 10, 99)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cos = TrainerConfig(steps=100, warmup_steps=10, lr_schedule="cosine")
    assert lr_factor(cos, 9) == 1.0 and lr_factor(cos, 10) == 1.0
    assert lr_factor(cos, 55) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert lr_factor(cos, 100) == pytest.approx(0.1) and lr_factor(cos, 500) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="trainer.lr_schedule"):
        TrainerConfig(lr_schedule="linear")


def test_entropy_metric_equals_masked_mean_of_entropy_from_logits():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, VOCAB, generator=gen) * 3
    labels = torch.randint(0, VOCAB, (3, 6), generator=gen)
    labels[0, :4] = -100  # prompt and padding positions
    labels[2] = -100  # a row with nothing trained
    trainer = LocalTrainer(_model(), TrainerConfig(), AlgorithmConfig(preset="grpo"), temperature=0.7)
    full = entropy_from_logits(logits, labels, temperature=0.7)  # 0 where not trained
    assert trainer._entropy_sum(logits, labels) == pytest.approx(float(full.sum()), rel=1e-6)
    # hand check of one position: H = -sum p log p of softmax(logits[1, 2] / 0.7) describes labels[1, 3]
    p = (logits[1, 2] / 0.7).softmax(-1)
    assert float(full[1, 3]) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert trainer._entropy_sum(logits, torch.full_like(labels, -100)) == 0.0


@pytest.mark.parametrize("share_prompt", [True, False])
def test_activation_checkpointing_gives_the_same_step(share_prompt):
    """Per-layer recomputation in the backward pass changes memory, not the step's values or weights."""
    results = []
    for ac in (False, True):
        torch.manual_seed(0)
        cfg = TrainerConfig(lr=1e-2, share_prompt=share_prompt, activation_checkpointing=ac)
        trainer = LocalTrainer(_model(), cfg, AlgorithmConfig())
        stats = trainer.train_step(build_train_batch(_groups(), pad_id=PAD))
        results.append((stats.pg_loss, stats.grad_norm, trainer.named_weights()))
    (loss0, norm0, w0), (loss1, norm1, w1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-6) and norm1 == pytest.approx(norm0, rel=1e-6)
    assert all(torch.allclose(w0[k], w1[k], rtol=1e-5, atol=1e-7) for k in w0)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_activation_checkpointing_recomputes_every_layer_in_backward(share_prompt):
    """With it on, every decoder layer runs again inside backward, once per gradient-enabled forward
    (the recompute); with it off, no layer runs inside backward (hooks count layer calls; the equal-values
    test above cannot tell a recompute from a plain call)."""
    counts = {}
    for ac in (False, True):
        model = _model()
        trainer = LocalTrainer(
            model, TrainerConfig(share_prompt=share_prompt, activation_checkpointing=ac), AlgorithmConfig()
        )
        batch = build_train_batch(_groups(), pad_id=PAD)
        with layer_forwards(model) as counts[ac]:
            trainer.train_step(batch)
    layers = range(len(model.layers))
    assert all(counts[False]["forward"][i] > 0 for i in layers)
    assert sum(counts[False]["backward"].values()) == 0, counts[False]
    assert counts[True]["forward"] == counts[False]["forward"]
    assert all(counts[True]["backward"][i] == counts[True]["forward"][i] for i in layers), counts[True]
