"""CPU checks of the fast paths' logic (moerl.models.kernels, moerl.rollout.cuda_graphs).

The Triton kernels themselves run only on CUDA (bench/gpu_checks.py checks them there against these
tensor-op references); on CPU the same functions take their tensor-op paths, checked here against the
eager ``Experts`` and against hand-computed values.
"""

from __future__ import annotations

import pytest
import torch

from moerl.models import kernels, layer_kernels
from moerl.models.moe import Experts
from moerl.rollout.cuda_graphs import GraphRunner


def test_expert_order_hand_example():
    idx = torch.tensor([[2, 0], [0, 1], [2, 2]])  # slots 0..5 -> experts 2,0,0,1,2,2
    order, inverse, offsets = kernels.expert_order_no_sync(idx, 4)
    assert order.tolist() == [1, 2, 3, 0, 4, 5]  # stable: expert 0 (slots 1, 2), 1 (3), 2 (0, 4, 5)
    assert inverse.tolist() == [3, 0, 1, 2, 4, 5]
    assert offsets.tolist() == [2, 3, 6, 6] and offsets.dtype == torch.int32  # expert 3 empty


def test_weighted_combine_hand_example():
    y = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # expert-sorted rows
    inverse = torch.tensor([2, 0, 3, 1])  # token 0 -> rows 2, 0; token 1 -> rows 3, 1
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    out = kernels.weighted_combine(y, inverse, w, 2)
    assert out.flatten().tolist() == [0.5 * 3 + 0.25 * 1, 1.0 * 4 + 2.0 * 2]
    assert kernels.gather_sum_rows(y, inverse, None, 2).flatten().tolist() == [4.0, 6.0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_experts_matches_experts_forward_and_backward(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    n, h, i, e, k = 23, 16, 8, 6, 3
    ex = Experts(e, h, i).to(dtype)
    with torch.no_grad():
        ex.gate_up_proj.copy_(0.3 * torch.randn(ex.gate_up_proj.shape, generator=gen))
        ex.down_proj.copy_(0.3 * torch.randn(ex.down_proj.shape, generator=gen))
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_(True)
    w, idx = torch.randn(n, e, generator=gen).softmax(-1).topk(k, dim=-1)
    w = w.clone().requires_grad_(True)
    ref = ex(x, idx, w)
    dy = torch.randn(ref.shape, generator=gen).to(dtype)
    g_ref = torch.autograd.grad(ref, [x, w, ex.gate_up_proj, ex.down_proj], dy)
    out = kernels.fused_experts(x, idx, w, ex.gate_up_proj, ex.down_proj)
    g = torch.autograd.grad(out, [x, w, ex.gate_up_proj, ex.down_proj], dy)

    def err(a, b):
        return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())

    assert out.dtype == dtype and err(out, ref) < tol
    for a, b in zip(g, g_ref, strict=True):
        assert err(a, b) < tol


def test_fast_path_switch_and_cpu_support():
    x, w = torch.zeros(2, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16)
    assert not layer_kernels.fused_rmsnorm_supported(x, w)  # CPU
    assert not layer_kernels.fused_rotary_supported(x[None, None], w[None, None], w[None, None], False)
    assert not kernels.fused_experts_supported(
        x, torch.zeros(2, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 4)
    )
    assert kernels.fast_paths_enabled()
    with kernels.fast_paths(False):
        assert not kernels.fast_paths_enabled()
        with kernels.fast_paths(True):
            assert kernels.fast_paths_enabled()
        assert not kernels.fast_paths_enabled()
    assert kernels.fast_paths_enabled()


def test_graph_runner_runs_eagerly_off_cuda():
    runner = GraphRunner("cpu")
    calls = []

    def fn():
        calls.append(1)
        return (torch.tensor([len(calls)]),)

    assert runner.run("a", fn)[0].item() == 1 and runner.run("a", fn)[0].item() == 2
    assert not runner.is_enabled and runner.num_graphs == 0 and runner.num_replays == 0


def test_swiglu_reference_path():
    gu = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, 2.0, 0.5, -4.0]])  # I = 2: gate columns 0-1, up 2-3
    silu = gu[:, :2] * torch.sigmoid(gu[:, :2])
    assert torch.allclose(kernels.swiglu(gu), silu * gu[:, 2:])
