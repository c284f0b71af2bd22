"""Router and router-loss cases with hand-computed answers."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.models.moe import load_balancing_loss, route, router_z_loss


def _logit(p: list[float]) -> torch.Tensor:
    p_ = torch.tensor([p], dtype=torch.float64)
    return torch.log(p_ / (1 - p_)).float()


def test_sigmoid_top2_normalized():
    out = route(_logit([0.9, 0.8, 0.3, 0.1]), top_k=2, scoring_func="sigmoid", norm_topk_prob=True)
    assert out.topk_idx.tolist() == [[0, 1]]
    # 0.9 / 1.7 = 0.52941, 0.8 / 1.7 = 0.47059
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.5294, 0.4706]]), atol=1e-4, rtol=0)
    assert out.topk_weights.dtype == torch.float32


def test_sigmoid_unnormalized_and_scaled():
    out = route(_logit([0.9, 0.8, 0.3, 0.1]), top_k=2, scoring_func="sigmoid", routed_scaling_factor=2.5)
    torch.testing.assert_close(out.topk_weights, torch.tensor([[2.25, 2.0]]), atol=1e-5, rtol=0)


def test_top1_normalization_is_per_token():
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 0.1, 0.2], [-3.0, 2.0, 1.0]])
    out = route(logits, top_k=1, norm_topk_prob=True)
    assert out.topk_idx.flatten().tolist() == [0, 2, 1]
    torch.testing.assert_close(out.topk_weights, torch.ones(3, 1))


def test_softmax_unnormalized_weights_are_probabilities():
    out = route(torch.tensor([[math.log(3.0), 0.0, 0.0]]), top_k=2)  # softmax = [3/5, 1/5, 1/5]
    assert out.topk_idx[0, 0].item() == 0
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.6, 0.2]]))


def test_group_limited_routing_keeps_groups_by_top2_sum():
    # groups of 2: sums 0.95, 1.2, 1.0, 0.2 -> keep groups 1 and 2; the single best expert 0 is excluded
    scores = [0.95, 0.0001, 0.6, 0.59, 0.5, 0.49, 0.1, 0.1]
    out = route(_logit(scores), top_k=2, scoring_func="sigmoid", n_group=4, topk_group=2)
    assert sorted(out.topk_idx[0].tolist()) == [2, 3]
    ungrouped = route(_logit(scores), top_k=2, scoring_func="sigmoid")
    assert sorted(ungrouped.topk_idx[0].tolist()) == [0, 2]


def test_discarded_groups_are_minus_inf_and_bias_only_selects():
    # scores + bias = [-1.1, -1.2, -2.4, -2.4]; group 0 wins (-2.3 vs -4.8). Masking the losing group to 0
    # instead of -inf would pick experts 2 and 3.
    bias = torch.tensor([-2.0, -2.0, -2.5, -2.5])
    out = route(
        _logit([0.9, 0.8, 0.1, 0.1]),
        top_k=2,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        correction_bias=bias,
    )
    assert out.topk_idx[0].tolist() == [0, 1]
    # combine weights come from the unbiased scores 0.9 and 0.8
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.5294, 0.4706]]), atol=1e-4, rtol=0)


def test_correction_bias_changes_selection_not_weights():
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    out = route(_logit([0.9, 0.8, 0.3, 0.1]), top_k=2, scoring_func="sigmoid", correction_bias=bias)
    assert sorted(out.topk_idx[0].tolist()) == [0, 2]
    got = dict(zip(out.topk_idx[0].tolist(), out.topk_weights[0].tolist(), strict=True))
    assert got == pytest.approx({0: 0.9, 2: 0.3}, abs=1e-6)


def test_forced_experts_take_weights_of_forced_ids():
    out = route(
        _logit([0.9, 0.8, 0.3, 0.1]),
        top_k=2,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        forced_idx=torch.tensor([[2, 3]]),
    )
    assert out.topk_idx.tolist() == [[2, 3]]
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.75, 0.25]]))  # 0.3 / 0.4, 0.1 / 0.4
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        route(torch.zeros(1, 4), top_k=2, forced_idx=torch.tensor([[0, 4]]))


def test_aux_loss_hand_value():
    # softmax([4,0,0,0])_0 = e^4 / (e^4 + 3) = 0.947917; both tokens -> expert 0: f = [1,0,0,0]
    logits = torch.tensor([[4.0, 0, 0, 0], [4.0, 0, 0, 0]])
    idx = route(logits, top_k=1).topk_idx
    loss = load_balancing_loss(logits, idx)
    assert loss.item() == pytest.approx(3.7917, abs=1e-4)
    assert loss.item() == pytest.approx(4 * math.exp(4) / (math.exp(4) + 3), rel=1e-6)


def test_aux_loss_excludes_padding():
    # the pad token routes to expert 1 and would make the batch look balanced: f = P = [0.5, 0.5] -> 1.0
    logits = torch.tensor([[4.0, 0.0], [4.0, 0.0], [0.0, 4.0], [0.0, 4.0]])
    idx = route(logits, top_k=1).topk_idx
    mask = torch.tensor([True, True, False, False])
    assert load_balancing_loss(logits, idx).item() == pytest.approx(1.0, abs=1e-6)
    expected = 2 * math.exp(4) / (math.exp(4) + 1)  # unpadded: f = [1, 0], P_0 = 0.98201 -> 1.96403
    assert load_balancing_loss(logits, idx, mask).item() == pytest.approx(expected, rel=1e-6)
    assert load_balancing_loss(logits[:2], idx[:2]).item() == pytest.approx(expected, rel=1e-6)


def test_aux_loss_uniform_is_k():
    logits = torch.zeros(4, 4)
    idx = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balancing_loss(logits, idx).item() == pytest.approx(2.0)


def test_z_loss_hand_value_and_padding():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: log 2, log 4
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, rel=1e-6)
    mask = torch.tensor([True, False])
    assert router_z_loss(logits, mask).item() == pytest.approx(math.log(2) ** 2, rel=1e-6)
