"""Dispatchers on a one-rank gloo group: autograd checked numerically (float64 gradcheck) through
dispatch -> experts -> combine, the returned layout, and ``parallelize`` argument errors."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moerl.ep import AllToAllDispatcher, EPInputError, HierarchicalDispatcher, Topology
from moerl.ep.layout import Traffic
from moerl.ep.parallelize import ExpertParallelExperts, parallelize, replicated_parameters

DISPATCHERS = [AllToAllDispatcher, HierarchicalDispatcher]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = tmp_path_factory.mktemp("ep") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def _moe(disp, x, w, gate_up, down, idx):
    recv_x, handle = disp.dispatch(x, idx, w)
    counts = handle.tokens_per_local_expert
    ys = [torch.tanh(xe @ gate_up[e]) @ down[e] for e, xe in enumerate(recv_x.split(counts.tolist()))]
    return disp.combine(torch.cat(ys), handle)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_gradcheck_dispatch_combine(one_rank, cls):
    """Float64 numerical gradients of x, router weights and experts match the autograd ones, which
    exercises backward(dispatch) = combine and backward(combine) = dispatch."""
    disp = cls(Topology(1, 1), 3)
    idx = torch.tensor([[0, 2], [1, -1], [2, 1], [-1, -1], [0, 1]])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: _moe(disp, *a, idx), (x, w, gate_up, down), fast_mode=True)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_dispatch_layout_and_combine_values(one_rank, cls):
    disp = cls(Topology(1, 1), 3)
    idx = torch.tensor([[2, 0], [0, -1], [2, 1]])
    x = torch.tensor([[1.0], [2.0], [3.0]])
    w = torch.tensor([[0.5, 0.25], [1.0, 9.0], [2.0, 3.0]])
    recv_x, handle = disp.dispatch(x, idx, w)
    counts = handle.tokens_per_local_expert
    assert counts.tolist() == [2, 1, 2]
    assert recv_x.flatten().tolist() == [1.0, 2.0, 3.0, 1.0, 3.0]  # by expert, then token
    assert handle.recv_weights.tolist() == [0.25, 1.0, 3.0, 0.5, 2.0]
    out = disp.combine(recv_x * 10, handle)
    assert out.dtype == torch.float32
    assert out.flatten().tolist() == [7.5, 20.0, 150.0]  # 10 * x_t * sum of its weights
    assert disp.last_traffic.inter_node_bytes == 0 and disp.last_traffic.intra_node_bytes == 0


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_no_grad_round_trip_equals_autograd_one(one_rank, cls):
    """Inputs that need no gradient skip the autograd nodes (host time per call) with the same values;
    a group of one rank sends nothing, so its traffic counters stay zero."""
    disp = cls(Topology(1, 1), 4)
    idx = torch.tensor([[3, 0], [1, -1], [2, 1], [0, 3]])
    x, w = torch.randn(4, 5), torch.rand(4, 2)
    recv_x, handle = disp.dispatch(x, idx, w)
    counts = handle.tokens_per_local_expert
    out = disp.combine(recv_x * 3, handle)
    assert recv_x.grad_fn is None and out.grad_fn is None
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    recv_g, handle_g = disp.dispatch(xg, idx, wg)
    counts_g = handle_g.tokens_per_local_expert
    out_g = disp.combine(recv_g * 3, handle_g)
    assert out_g.grad_fn is not None
    assert torch.equal(recv_x, recv_g.detach()) and torch.equal(counts, counts_g)
    assert torch.equal(out, out_g.detach())
    with torch.no_grad():
        recv_n, handle_n = disp.dispatch(xg, idx, wg)
        assert disp.combine(recv_n, handle_n).grad_fn is None
    out_g.sum().backward()
    assert disp.total_traffic == disp.last_traffic == Traffic()


def test_bad_input_single_rank(one_rank):
    disp = HierarchicalDispatcher(Topology(1, 1), 2)
    with pytest.raises(EPInputError, match="ids in"):
        disp.dispatch(torch.zeros(2, 3), torch.tensor([[0], [2]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="combine: y must be"):
        _, h = disp.dispatch(torch.zeros(2, 3), torch.tensor([[0], [1]]), torch.ones(2, 1))
        disp.combine(torch.zeros(5, 3), h)
    with pytest.raises(ValueError, match="world_size=2 but the EP process group has 1"):
        AllToAllDispatcher(Topology(2, 1), 2)


class _ToyExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 6, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 3))


class _ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _ToyExperts()


def test_parallelize_swaps_experts_and_checks_arguments(one_rank):
    model = nn.Sequential(_ToyBlock(), _ToyBlock())
    parallelize(model, dispatcher="alltoall", topology=Topology(1, 1))
    assert all(isinstance(b.experts, ExpertParallelExperts) for b in model)
    assert model[0].experts.gate_up_proj.shape == (4, 6, 8)
    model.append(nn.Linear(2, 2))
    assert [n for n, _ in replicated_parameters(model)] == ["2.weight", "2.bias"]
    with pytest.raises(ValueError, match="unknown dispatcher"):
        parallelize(nn.Sequential(_ToyBlock()), dispatcher="ring")
    with pytest.raises(ValueError, match="no MoE block"):
        parallelize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="dispatcher has 2 experts"):
        parallelize(nn.Sequential(_ToyBlock()), dispatcher=AllToAllDispatcher(Topology(1, 1), 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
@pytest.mark.parametrize("cls", DISPATCHERS)
def test_nccl_single_gpu(one_rank, cls):
    """The NCCL path: every tensor of dispatch/combine/backward stays on the GPU and the results
    equal the gloo/CPU ones; float64 gradcheck on the GPU."""
    nccl = dist.new_group([0], backend="nccl")
    gpu, cpu = cls(Topology(1, 1), 3, nccl), cls(Topology(1, 1), 3)
    idx = torch.tensor([[0, 2], [1, -1], [2, 1], [-1, -1], [0, 1]])
    args = [torch.randn(5, 4), torch.rand(5, 2), torch.randn(3, 4, 6), torch.randn(3, 6, 4)]
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for disp, dev in ((gpu, "cuda"), (cpu, "cpu")):
            leaves = [
                a.to(dev, dtype if i != 1 else torch.float32).clone().requires_grad_()
                for i, a in enumerate(args)
            ]
            out = _moe(disp, *leaves, idx.to(dev))
            out.sum().backward()
            outs.append([out.detach().cpu()] + [a.grad.cpu() for a in leaves])
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        for a, b in zip(*outs, strict=True):  # error relative to the tensor's largest entry
            assert float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())
    leaves = [a.to("cuda", torch.float64).clone().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(lambda *a: _moe(gpu, *a, idx.cuda()), tuple(leaves))
