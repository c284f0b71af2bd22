"""The EP dispatcher interface (``moerl.ep.Dispatcher``) on a one-rank gloo group: every registered
backend implements it, an MoE layer sharded through ``parallelize`` equals the dense single-device layer
in value and in every gradient (router weights included) for each of them, and a backend written in one
file (``_ep_backend.py``, registered here with one line) plugs in by name."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _ep_backend import DelegatingDispatcher
from torch import nn

from moerl.ep import DISPATCHERS, Dispatcher, DispatchHandle, Topology, build_dispatcher
from moerl.ep.parallelize import DISPATCHERS as PARALLELIZE_DISPATCHERS
from moerl.ep.parallelize import ExpertParallelExperts, parallelize
from moerl.models.moe import Experts


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = tmp_path_factory.mktemp("ep_interface") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def with_test_backend(monkeypatch):
    """The one registry line a new backend adds, for this test only."""
    monkeypatch.setitem(DISPATCHERS, "delegating", DelegatingDispatcher)


BACKENDS = [*DISPATCHERS, "delegating"]


class _Block(nn.Module):
    """The seam ``parallelize`` swaps: ``experts(x, topk_idx, topk_weights)``."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x, topk_idx, topk_weights):
        return self.experts(x, topk_idx, topk_weights)


def _dense_block(num_experts: int, hidden: int, inter: int) -> _Block:
    experts = Experts(num_experts, hidden, inter, use_grouped_mm=False).double()
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    return _Block(experts)


def _grads(block: _Block, x, idx, w, cot) -> dict[str, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = block(x, idx, w)
    (out * cot).sum().backward()
    return {
        "out": out.detach(),
        "x": x.grad,
        "topk_weights": w.grad,
        "gate_up_proj": block.experts.gate_up_proj.grad,
        "down_proj": block.experts.down_proj.grad,
    }


def test_registry_is_one_table(one_rank):
    """``moerl.ep.DISPATCHERS`` is the table ``parallelize`` reads; an unknown name lists the registered
    ones."""
    assert PARALLELIZE_DISPATCHERS is DISPATCHERS
    assert set(DISPATCHERS) >= {"alltoall", "hierarchical"}
    with pytest.raises(ValueError, match=r"unknown dispatcher 'ring'; choose one of \['alltoall', 'hier"):
        build_dispatcher("ring", Topology(1, 1), 4)


@pytest.mark.parametrize("name", BACKENDS)
def test_backends_implement_the_protocol(one_rank, with_test_backend, name):
    disp = build_dispatcher(name, Topology(1, 1), 4)
    assert isinstance(disp, Dispatcher)
    x, idx, w = torch.randn(3, 5), torch.tensor([[0, 3], [2, -1], [3, 1]]), torch.rand(3, 2)
    recv_x, handle = disp.dispatch(x, idx, w)
    assert isinstance(handle, DispatchHandle)
    assert handle.tokens_per_local_expert.tolist() == [1, 1, 1, 2] and handle.num_tokens == 3
    assert recv_x.shape == (5, 5)
    assert disp.combine(recv_x, handle).shape == (3, 5)


@pytest.mark.parametrize("name", BACKENDS)
def test_sharded_layer_equals_the_dense_layer_with_gradients(one_rank, with_test_backend, name):
    """Forward value and the gradients of x, the router weights and both expert tensors of an MoE layer
    sharded with backend ``name`` equal those of the same layer on one device (float64, -1 slots and an
    expert without tokens included), and float64 gradcheck passes through dispatch -> experts -> combine.
    Fails if a backend's backward is missing (no gradient) or wrong."""
    torch.manual_seed(0)
    dense = _dense_block(num_experts=4, hidden=6, inter=5)
    sharded = parallelize(_Block(Experts(4, 6, 5, use_grouped_mm=False).double()), dispatcher=name)
    assert isinstance(sharded.experts, ExpertParallelExperts)
    with torch.no_grad():
        sharded.experts.gate_up_proj.copy_(dense.experts.gate_up_proj)
        sharded.experts.down_proj.copy_(dense.experts.down_proj)
    x, cot = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)
    idx = torch.tensor([[0, 2], [1, 0], [2, -1], [0, 1], [1, 2], [2, 0], [-1, 1]])  # expert 3: no token
    w = torch.rand(7, 2, dtype=torch.float64)
    # the dense layer has no empty slot: its -1 entries are a zero-weight route to expert 0
    want = _grads(dense, x, idx.clamp(min=0), torch.where(idx >= 0, w, 0.0), cot)
    want["topk_weights"] = torch.where(idx >= 0, want["topk_weights"], 0.0)
    got = _grads(sharded, x, idx, w, cot)
    for key, value in want.items():
        assert got[key] is not None, f"{name}: no gradient for {key}"
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-12, msg=f"{name}: {key}")

    def layer(x, w, gate_up, down):
        recv_x, handle = sharded.experts.dispatcher.dispatch(x, idx, w)
        sizes = handle.tokens_per_local_expert.tolist()
        ys = []
        for e, xe in enumerate(recv_x.split(sizes)):
            gate, up = (xe @ gate_up[e].T).chunk(2, dim=-1)
            ys.append((torch.tanh(gate) * up) @ down[e].T)
        return sharded.experts.dispatcher.combine(torch.cat(ys), handle)

    leaves = [x, w, dense.experts.gate_up_proj.detach(), dense.experts.down_proj.detach()]
    assert torch.autograd.gradcheck(layer, [t.clone().requires_grad_() for t in leaves], fast_mode=True)
