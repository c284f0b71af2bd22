"""Stacked experts: grouped GEMM == per-expert loop == dense reference; gradients reach router and experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moerl.models.config import MoeConfig
from moerl.models.moe import Experts, MoeBlock, grouped_expert_mlp, grouped_mm_supported

E, H, INTER = 4, 16, 8


def _reference(x, idx, w, gate_up, down):
    """sum_j w_j * down_e(silu(gate_e x) * up_e x), one token at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            g, u = (gate_up[e] @ x[n]).chunk(2)
            out[n] += w[n, j] * (down[e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop(dtype):
    if not grouped_mm_supported(torch.zeros(1, dtype=dtype), H, 2 * INTER, INTER):
        pytest.skip("torch._grouped_mm unavailable for this dtype/device")
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets no tokens
    x = torch.randn(int(counts.sum()), H, dtype=dtype)
    gate_up, down = torch.randn(E, 2 * INTER, H, dtype=dtype), torch.randn(E, H, INTER, dtype=dtype)
    a = grouped_expert_mlp(x, counts, gate_up, down, use_grouped_mm=True)
    b = grouped_expert_mlp(x, counts, gate_up, down, use_grouped_mm=False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(a, b, **tol)
    assert a.dtype == dtype and a.shape == (10, H)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_no_tokens_gives_empty_output_and_zero_grads(use_grouped_mm):
    """An EP rank may receive no tokens; it still takes part in backward with zero gradients."""
    gate_up = torch.randn(E, 2 * INTER, H, requires_grad=True)
    down = torch.randn(E, H, INTER, requires_grad=True)
    y = grouped_expert_mlp(
        torch.zeros(0, H), torch.zeros(E, dtype=torch.long), gate_up, down, use_grouped_mm=use_grouped_mm
    )
    assert y.shape == (0, H)
    y.sum().backward()
    assert torch.count_nonzero(gate_up.grad) == 0 and torch.count_nonzero(down.grad) == 0


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_experts_match_reference_and_zero_token_expert_has_zero_grad(use_grouped_mm):
    experts = Experts(E, H, INTER, use_grouped_mm=use_grouped_mm)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(5, H, requires_grad=True)
    idx = torch.tensor([[0, 2], [2, 3], [3, 0], [0, 2], [2, 3]])  # expert 1 receives nothing
    w = torch.rand(5, 2)
    y = experts(x, idx, w)
    ref = _reference(x.detach(), idx, w, experts.gate_up_proj.detach(), experts.down_proj.detach())
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    y.square().sum().backward()
    g = experts.gate_up_proj.grad
    assert g is not None and experts.down_proj.grad is not None
    assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(experts.down_proj.grad[1]) == 0
    assert all(torch.count_nonzero(g[e]) > 0 for e in (0, 2, 3))


def test_grouped_backward_equals_loop_backward():
    if not grouped_mm_supported(torch.zeros(1), H, 2 * INTER, INTER):
        pytest.skip("torch._grouped_mm unavailable")
    grads = []
    for flag in (True, False):
        torch.manual_seed(3)
        experts = Experts(E, H, INTER, use_grouped_mm=flag)
        with torch.no_grad():
            experts.gate_up_proj.normal_()
            experts.down_proj.normal_()
        x = torch.randn(6, H)
        idx = torch.tensor([[0, 1], [1, 0], [3, 0], [0, 3], [1, 3], [3, 1]])
        experts(x, idx, torch.rand(6, 2)).sum().backward()  # sum(): stride-0 gradient into the grouped GEMM
        grads.append((experts.gate_up_proj.grad, experts.down_proj.grad))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_gradients_reach_router_and_experts(scoring):
    cfg = MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=2,
        scoring_func=scoring,
        norm_topk_prob=scoring == "sigmoid",
        shared_intermediate_size=8,
        shared_expert_gate=True,
        use_score_correction_bias=scoring == "sigmoid",
    )
    block = MoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    y, stats = block(torch.randn(2, 3, H))
    (y.square().mean() + stats.aux_loss + stats.z_loss).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert stats.topk_idx.shape == (6, 2) and stats.topk_idx.dtype == torch.int64
    assert block.router.e_score_correction_bias is None or block.router.e_score_correction_bias.grad is None


def test_experts_module_is_replaceable():
    """The EP seam: a module with the same call signature replaces block.experts."""
    cfg = MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=2)
    block = MoeBlock(cfg)
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, x, topk_idx, topk_weights):
            seen.update(
                x=x.shape, idx=(topk_idx.shape, topk_idx.dtype), w=(topk_weights.shape, topk_weights.dtype)
            )
            return torch.zeros_like(x)

    block.experts = Spy()
    y, _ = block(torch.randn(2, 3, H))
    assert torch.count_nonzero(y) == 0
    assert seen == {"x": (6, H), "idx": ((6, 2), torch.int64), "w": ((6, 2), torch.float32)}


def test_dense_experts_equal_the_routed_path():
    """The capture-safe path (every expert for every token, weighted) gives the routed result."""
    from moerl.models.moe import Experts, dense_experts

    torch.manual_seed(0)
    experts = Experts(8, 16, 12)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(10, 16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(10)])
    w = torch.rand(10, 2)
    dense = dense_experts(x, idx, w, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(dense, experts(x, idx, w), rtol=1e-5, atol=1e-6)
    w[3, 1] = 0.0  # an unselected expert contributes nothing, a zero weight neither
    torch.testing.assert_close(
        dense_experts(x, idx, w, experts.gate_up_proj, experts.down_proj),
        experts(x, idx, w),
        rtol=1e-5,
        atol=1e-6,
    )
