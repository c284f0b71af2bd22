"""Shared-prompt forward: the split by hand, agreement with the unshared forward, and bad batches."""

import copy

import pytest
import torch
from _tiny import tiny_model
from test_models import tiny

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.rl import token_logprobs
from moerl.trainer.batch import build_train_batch
from moerl.trainer.local import LocalTrainer
from moerl.trainer.shared_prefix import shared_prefix_forward, split_shared_prefix

VOCAB = 16
PAD = 0


def _groups(prompts_and_responses, seed=0):
    """Groups with rewards 0/1 alternating and behaviour log-probs near the model's (ratios ~1)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, (prompt, responses) in enumerate(prompts_and_responses):
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=r,
                response_logprobs=(-torch.rand(len(r), generator=gen) - 2.0).tolist(),
                loss_mask=[1] * len(r),
                finish_reason="stop",
                policy_versions=[0] * len(r),
                reward=float(i % 2),
            )
            for i, r in enumerate(responses)
        ]
        task = RolloutTask(
            task_id=f"t{g}", prompt_ids=prompt, prompt_text="p", answer="a", num_samples=len(samples)
        )
        groups.append(Group.from_lease(Lease(task, "w", g + 1, 0.0), samples, 0.1))
    return groups


# Prompts of 3, 1 and 5 tokens; responses of 0 to 4 tokens (a 0-token response is all padding).
RAGGED = [
    ([3, 4, 5], [[6, 7], [8], [9, 10, 11, 12]]),
    ([13], [[1, 2], [3]]),
    ([2, 3, 4, 5, 6], [[7], [], [8, 9]]),
]


def test_split_by_hand():
    batch = build_train_batch(_groups(RAGGED), pad_id=PAD)
    s = split_shared_prefix(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.group_ids)
    assert s.prefix_ids.tolist() == [[3, 4, 0, 0], [0, 0, 0, 0], [2, 3, 4, 5]]
    assert s.prefix_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert s.row_group.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    # suffix: last prompt token + response; row 0 is [3 4 5 6 7], row 6 [2 3 4 5 6] (empty response)
    assert s.suffix_ids[0].tolist() == [5, 6, 7, 0, 0]
    assert s.suffix_ids[2].tolist() == [5, 9, 10, 11, 12]
    assert s.suffix_ids[3].tolist() == [13, 1, 2, 0, 0]
    assert s.suffix_ids[6].tolist() == [6, 0, 0, 0, 0]
    assert s.suffix_mask[6].tolist() == [1, 0, 0, 0, 0]
    assert s.columns[0].tolist() == [2, 3, 4, 0, 0]
    assert s.columns[5].tolist() == [4, 5, 0, 0, 0]
    assert s.columns[4].tolist() == [0, 1, 0, 0, 0]  # also the position ids
    x = torch.arange(batch.input_ids.numel()).view(batch.input_ids.shape)
    back = s.to_batch(s.to_suffix(x, -1), batch.input_ids.shape[1])
    assert back[0].tolist() == [0, 0, 2, 3, 4, 0, 0]  # the suffix columns, zeros elsewhere


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_log_probs_gradients_and_routing_equal_the_unshared_forward(family):
    torch.manual_seed(0)
    model = tiny(family)  # deepseek_v3: MLA attention and a dense first layer, through the same cache seam
    batch = build_train_batch(_groups(RAGGED), pad_id=PAD)
    labels = torch.where(batch.loss_mask, batch.input_ids, -100)
    t = batch.input_ids.shape[1]
    twin = copy.deepcopy(model)

    full = model(batch.input_ids, batch.attention_mask, return_routed_experts=True)
    ref = token_logprobs(full.logits, labels)
    (ref * batch.advantages[:, None]).sum().backward()

    split = split_shared_prefix(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.group_ids)
    shared = shared_prefix_forward(twin, split, t, return_routed_experts=True)
    logp = split.to_batch(token_logprobs(shared.logits, split.to_suffix(labels, -100)), t)
    (logp * batch.advantages[:, None]).sum().backward()

    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
    assert bool((logp[batch.loss_mask] < 0).all())  # every trained token has a log-prob
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    real = batch.attention_mask.bool()
    assert torch.equal(shared.routed_experts[real], full.routed_experts[real])


def test_trainer_steps_agree_with_and_without_sharing():
    torch.manual_seed(1)
    model = tiny_model(VOCAB, max_position_embeddings=64)
    batch = build_train_batch(_groups(RAGGED, seed=2), pad_id=PAD)
    stats, params = {}, {}
    for share in (False, True):
        trainer = LocalTrainer(
            copy.deepcopy(model), TrainerConfig(lr=1e-2, share_prompt=share), AlgorithmConfig()
        )
        stats[share] = trainer.train_step(batch)
        params[share] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    a, b = stats[False], stats[True]
    for field in ("pg_loss", "entropy", "grad_norm", "ppo_kl", "expert_load_cv"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-4, abs=1e-6), field
    assert a.num_tokens == b.num_tokens
    torch.testing.assert_close(params[True], params[False], atol=1e-6, rtol=1e-5)


def test_nothing_to_share_and_bad_batches():
    one_token = build_train_batch(_groups([([5], [[1, 2], [3]])]), pad_id=PAD)
    assert (
        split_shared_prefix(
            one_token.input_ids, one_token.attention_mask, one_token.prompt_lens, one_token.group_ids
        )
        is None
    )
    batch = build_train_batch(_groups(RAGGED), pad_id=PAD)
    ids, attn, lens, gids = batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.group_ids
    other = ids.clone()
    other[1, 0] = 15  # row 1's prompt no longer matches its group's
    with pytest.raises(ValueError, match="share one prompt"):
        split_shared_prefix(other, attn, lens, gids)
    with pytest.raises(ValueError, match="prompt length"):
        split_shared_prefix(ids, attn, torch.zeros_like(lens), gids)
    with pytest.raises(ValueError, match="do not fit"):
        split_shared_prefix(ids, attn, lens[:-1], gids)
