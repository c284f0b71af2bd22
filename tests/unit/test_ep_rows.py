"""CPU checks of moerl.ep.rows (the tensor-op paths, which are the references of its Triton kernels;
bench/gpu_checks.py compares the kernels with them on a GPU) and of the models' routing-side fast paths."""

from __future__ import annotations

import pytest
import torch

from moerl.ep import rows
from moerl.models import kernels, moe_kernels
from moerl.models.layers import _attend
from moerl.models.moe import MoeLayerStats, load_balancing_loss, router_z_loss


def test_gather_rows2_hand_example():
    a, b = torch.tensor([[1.0], [2.0]]), torch.tensor([[10.0], [20.0], [30.0]])
    src = torch.tensor([4, 0, 2, 1])
    assert rows.gather_rows2(a, b, src).flatten().tolist() == [30.0, 1.0, 10.0, 2.0]
    scale = torch.tensor([1.0, 2.0, 0.5, 1.0, 0.1])
    got = rows.gather_rows2(a, b, src, scale=scale, out_dtype=torch.float32).flatten().tolist()
    assert got == pytest.approx([3.0, 1.0, 5.0, 4.0])


def test_gather_sum2_and_backward_match_autograd():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 5, -1], [2, -1, 7], [4, 1, 6], [3, -1, -1]])  # every row named once
    w = torch.rand(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    out = rows.gather_sum2(a, b, pos, w)
    cat = torch.cat([a, b, torch.zeros(1, 6, dtype=torch.float64)])
    ref = (cat[torch.where(pos >= 0, pos, 8)] * w[..., None]).sum(1)
    assert torch.allclose(out, ref)
    g = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(ref, [a, b, w], g)
    got = rows.gather_sum2_backward(g, a.detach(), b.detach(), pos, w.detach())
    for x, y in zip(got, want, strict=True):
        assert torch.allclose(x, y)
    assert rows.gather_sum2(a, b, pos).shape == (4, 6)
    assert rows.gather_slots2(torch.arange(5.0), torch.arange(3.0) + 10, pos).tolist()[1] == [2.0, 0.0, 12.0]


def test_positions_of_true_and_fp8_rows():
    mask = torch.tensor([False, True, True, False, True])
    assert rows.positions_of_true(mask, 3).tolist() == [1, 2, 4]
    assert rows.positions_of_true(torch.zeros(0, dtype=torch.bool), 0).tolist() == []
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different scales
    q, scale = rows.quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    back = q.float() * scale[:, None]
    assert float((back - x).norm() / x.norm()) < 5e-2
    assert float(((back - x).norm(dim=1) / x.norm(dim=1)).max()) < 8e-2  # per row, whatever its scale
    q0, s0 = rows.quantize_rows_fp8(torch.zeros(2, 4))
    assert s0.tolist() == [1.0, 1.0] and q0.float().abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_reference_and_grad(dtype):
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(7, 8, generator=gen).to(dtype).requires_grad_(True)
    w = torch.rand(7, generator=gen, requires_grad=True)
    out = kernels.swiglu(gu, w)
    g, u = gu.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u * w[:, None]
    assert out.dtype == dtype and torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)
    (dw,) = torch.autograd.grad(out.float().sum(), [w])
    assert torch.allclose(dw, (torch.nn.functional.silu(g) * u).sum(-1), rtol=2e-2, atol=2e-2)


def test_expert_layout_reference_hand_example():
    idx = torch.tensor([[2, 0], [0, 1], [2, 2]])
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    order, inverse, offsets, token, row_w = moe_kernels.expert_layout(idx, w, 4)
    assert order.tolist() == [1, 2, 3, 0, 4, 5] and inverse.tolist() == [3, 0, 1, 2, 4, 5]
    assert offsets.tolist() == [2, 3, 6, 6] and token.tolist() == [0, 1, 1, 0, 2, 2]
    assert row_w.tolist() == pytest.approx([0.2, 0.3, 0.4, 0.1, 0.5, 0.6])


def test_cpu_falls_back_for_routing_and_small_gemm():
    logits = torch.randn(4, 8)
    assert not moe_kernels.fused_route_supported(logits, 2)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert moe_kernels.router_logits_from_bf16(x, torch.randn(8, 16, dtype=torch.bfloat16)) is None
    assert not moe_kernels.small_grouped_mm_supported(x, torch.zeros(2, 8, 16, dtype=torch.bfloat16))


def test_causal_attention_without_mask_equals_tril_mask():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=gen) for _ in range(3))
    tril = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    assert torch.allclose(_attend(q, k, v, None, 0.5), _attend(q, k, v, tril, 0.5), atol=1e-6)


def test_router_losses_are_computed_on_read():
    logits = torch.randn(6, 4)
    idx = logits.topk(2, dim=-1).indices
    mask = torch.tensor([True, True, False, True, True, True])
    stats = MoeLayerStats(topk_idx=idx, router_logits=logits, token_mask=mask)
    assert torch.equal(stats.aux_loss, load_balancing_loss(logits, idx, mask))
    assert torch.equal(stats.z_loss, router_z_loss(logits, mask))
    # the load-balancing counts without a one-hot tensor: E * sum_i f_i P_i by hand
    keep = mask.nonzero().flatten()
    f = torch.zeros(4).index_add_(0, idx[keep].flatten(), torch.ones(keep.numel() * 2)) / keep.numel()
    p = logits[keep].softmax(-1).mean(0)
    assert float(stats.aux_loss) == pytest.approx(float(4 * (f * p).sum()), rel=1e-6)
