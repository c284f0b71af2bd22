"""EP dispatcher cases run inside one spawned gloo world (see dist_harness.run_world).

Every rank builds the same global problem from a shared seed (all ranks' tokens, routing, router
weights and experts), computes the single-process reference MoE layer on it, then runs its own slice
through each dispatcher with its local experts and compares outputs and gradients with the reference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moerl.ep import AllToAllDispatcher, EPInputError, ExpertPlacement, HierarchicalDispatcher, Topology
from moerl.ep.placement import node_limited_topk
from moerl.models.moe import grouped_expert_mlp

DISPATCHERS = {"alltoall": AllToAllDispatcher, "hierarchical": HierarchicalDispatcher}
INTERMEDIATE = 40


@dataclass(frozen=True)
class Case:
    name: str
    routing: str  # random | node_limited | skewed | minus_one | avoid_rank
    hidden: int = 72  # not a multiple of 128
    zero_rank: int | None = None  # this rank has no tokens and (avoid_rank) receives none
    placement: str = "contiguous"


CASES = [
    Case("random", "random"),
    Case("node_limited", "node_limited"),
    Case("skewed", "skewed"),
    Case("minus_one", "minus_one"),
    Case("zero_rank", "avoid_rank", zero_rank=1),
    Case("hidden200", "random", hidden=200),
    Case("round_robin", "minus_one", placement="round_robin"),
]


def tokens_per_rank(world: int, zero_rank: int | None) -> list[int]:
    return [0 if r == zero_rank else 13 + 5 * r for r in range(world)]


def make_problem(case: Case, topo: Topology, num_experts: int, top_k: int, dtype: torch.dtype) -> dict:
    """The global problem, identical on every rank (seeded)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{topo.ranks_per_node}".encode()))
    counts = tokens_per_rank(topo.world_size, case.zero_rank)
    t, h, e = sum(counts), case.hidden, num_experts
    placement = ExpertPlacement(e, topo, case.placement)
    scores = torch.randn(t, e, generator=gen)
    if case.routing == "avoid_rank":
        scores[:, placement.local_experts(case.zero_rank)] = float("-inf")
    if case.routing == "node_limited":
        idx = node_limited_topk(scores, top_k, 1, placement)
    else:
        idx = scores.topk(top_k, dim=-1).indices
    if case.routing == "skewed":
        idx = torch.full_like(idx, -1)
        idx[:, 0] = e - 1  # every token to one expert
    if case.routing == "minus_one":
        idx[torch.rand(idx.shape, generator=gen) < 0.4] = -1
        idx[:3] = -1  # a few tokens with no expert at all
    return {
        "counts": counts,
        "idx": idx,
        "w": torch.rand(t, top_k, generator=gen),
        "x": torch.randn(t, h, generator=gen).to(dtype),
        "gate_up": (torch.randn(e, 2 * INTERMEDIATE, h, generator=gen) / h**0.5).to(dtype),
        "down": (torch.randn(e, h, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5).to(dtype),
        "cot": torch.randn(t, h, generator=gen),
    }


def reference_moe(x, idx, w, gate_up, down):
    """Single-process MoE layer: out[t] = sum_j w[t, j] * SwiGLU_{idx[t, j]}(x[t]), all float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(gate_up.shape[0]):
        mask = idx == e
        rows = torch.nonzero(mask.any(1)).flatten()
        if rows.numel() == 0:
            continue
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out = out.index_add(0, rows, (w * mask).sum(1)[rows, None] * y)
    return out


def reference_grads(p: dict) -> dict:
    leaves = {k: p[k].float().clone().requires_grad_() for k in ("x", "w", "gate_up", "down")}
    out = reference_moe(leaves["x"], p["idx"], leaves["w"], leaves["gate_up"], leaves["down"])
    (out * p["cot"]).sum().backward()
    return {"out": out.detach(), **{k: v.grad for k, v in leaves.items()}}


def run_ep(disp, p: dict, rank: int) -> dict:
    """This rank's slice through dispatch -> local experts -> combine, forward and backward."""
    lo = sum(p["counts"][:rank])
    sl = slice(lo, lo + p["counts"][rank])
    local = disp.local_experts
    x = p["x"][sl].clone().requires_grad_()
    w = p["w"][sl].clone().requires_grad_()
    gate_up = p["gate_up"][local].clone().requires_grad_()
    down = p["down"][local].clone().requires_grad_()
    recv_x, handle = disp.dispatch(x, p["idx"][sl], w)
    per_expert = handle.tokens_per_local_expert
    traffic = disp.last_traffic
    y = grouped_expert_mlp(recv_x, per_expert, gate_up, down)
    out = disp.combine(y, handle)
    (out * p["cot"][sl]).sum().backward()
    return {
        "out": out.detach(),
        "x": x.grad,
        "w": w.grad,
        "gate_up": gate_up.grad,
        "down": down.grad,
        "recv_x": recv_x.detach(),
        "per_expert": per_expert,
        "traffic": traffic,
        "slice": sl,
        "local": local,
    }


def rel_errors(got: dict, ref: dict) -> dict[str, float]:
    """max |EP - reference| / max |reference| of the output and each gradient, on this rank's part."""
    sl, local = got["slice"], got["local"]
    want = {
        "out": ref["out"][sl],
        "x": ref["x"][sl],
        "w": ref["w"][sl],
        "gate_up": ref["gate_up"][local],
        "down": ref["down"][local],
    }
    return {
        k: float((got[k].float() - v).abs().max()) / max(float(v.abs().max()), 1e-30) if v.numel() else 0.0
        for k, v in want.items()
    }


def predicted_dispatch_traffic(
    p: dict, topo: Topology, placement: ExpertPlacement, rank: int, hierarchical: bool, elem: int
) -> tuple[int, int]:
    """(intra, inter) dispatch bytes sent by ``rank``, counted with plain loops over the global routing."""
    h, k = p["x"].shape[1], p["idx"].shape[1]
    owner = placement.expert_rank.tolist()
    starts = [sum(p["counts"][:s]) for s in range(topo.world_size)]
    rows = [[owner[e] for e in row if e >= 0] for row in p["idx"].tolist()]
    intra = inter = 0
    me_node, g = topo.node_of(rank), topo.ranks_per_node
    if not hierarchical:
        for ranks in rows[starts[rank] : starts[rank] + p["counts"][rank]]:
            for d in ranks:
                if d != rank:
                    intra += (h * elem + 4) * topo.is_same_node(rank, d)
                    inter += (h * elem + 4) * (not topo.is_same_node(rank, d))
        return intra, inter
    row_bytes = h * elem + 8 * k
    for s in range(topo.world_size):
        for ranks in rows[starts[s] : starts[s] + p["counts"][s]]:
            nodes = {topo.node_of(d) for d in ranks}
            if s == rank:
                inter += row_bytes * len(nodes - {me_node})
            if topo.local_index(s) == topo.local_index(rank) and me_node in nodes:  # I forward it
                intra += row_bytes * len({d for d in ranks if topo.node_of(d) == me_node} - {rank})
    del g
    return intra, inter


def run_cases(rank: int, world: int, ranks_per_node_list: list[int], num_experts: int, top_k: int) -> dict:
    """All correctness cases for each topology, dispatcher and dtype; returns {key: measurements}."""
    results = {}
    for g in ranks_per_node_list:
        topo = Topology(world, g)
        by_placement = {
            kind: {name: cls(topo, num_experts, placement=kind) for name, cls in DISPATCHERS.items()}
            for kind in ("contiguous", "round_robin")
        }
        for case in CASES:
            disps = by_placement[case.placement]
            for dtype in (torch.float32, torch.bfloat16):
                p = make_problem(case, topo, num_experts, top_k, dtype)
                ref = reference_grads(p)
                got = {name: run_ep(d, p, rank) for name, d in disps.items()}
                for name, res in got.items():
                    elem = p["x"].element_size()
                    results[(g, case.name, name, str(dtype))] = {
                        "errors": rel_errors(res, ref),
                        "traffic": res["traffic"],
                        "predicted": predicted_dispatch_traffic(
                            p, topo, disps[name].placement, rank, name == "hierarchical", elem
                        ),
                        "num_tokens": res["out"].shape[0],
                        "expert_grad_abs": float(res["gate_up"].abs().sum() + res["down"].abs().sum()),
                        "same_recv_as_alltoall": bool(
                            torch.equal(res["recv_x"], got["alltoall"]["recv_x"])
                            and torch.equal(res["per_expert"], got["alltoall"]["per_expert"])
                        ),
                    }
        disps = by_placement["contiguous"]
        results[(g, "fp8")] = check_fp8(disps["alltoall"], topo, num_experts, top_k, rank)
        results[(g, "deterministic")] = check_deterministic(disps, topo, num_experts, top_k, rank)
        results[(g, "order")] = check_order(disps, world, num_experts, top_k, rank)
    results["bad_input"] = run_bad_inputs(rank, world, num_experts, top_k)
    return results


def check_fp8(bf16_disp, topo: Topology, num_experts: int, top_k: int, rank: int) -> dict:
    """The flat dispatcher with ``fp8_dispatch`` against its bfloat16 run on the same problem: output and
    gradient errors, and the dispatch bytes (H + 4 + 4 per row: e4m3 values, the token's scale, the weight)."""
    p = make_problem(CASES[0], topo, num_experts, top_k, torch.bfloat16)
    fp8 = AllToAllDispatcher(topo, num_experts, fp8_dispatch=True)
    a, b = run_ep(bf16_disp, p, rank), run_ep(fp8, p, rank)
    h = p["x"].shape[1]
    return {
        "errors": {
            k: float((b[k].float() - a[k].float()).norm() / a[k].float().norm().clamp_min(1e-30))
            for k in ("out", "x", "w", "gate_up", "down")
            if a[k].numel()
        },
        "bytes": b["traffic"].intra_node_bytes + b["traffic"].inter_node_bytes,
        "expected_bytes": (a["traffic"].intra_node_bytes + a["traffic"].inter_node_bytes)
        // (2 * h + 4)
        * (h + 8),
    }


def check_deterministic(disps: dict, topo: Topology, num_experts: int, top_k: int, rank: int) -> bool:
    p = make_problem(CASES[0], topo, num_experts, top_k, torch.float32)
    same = True
    for d in disps.values():
        a, b = run_ep(d, p, rank), run_ep(d, p, rank)
        same &= all(torch.equal(a[k], b[k]) for k in ("out", "x", "w", "gate_up", "down"))
    return same


def check_order(disps: dict, world: int, num_experts: int, top_k: int, rank: int) -> dict[str, bool]:
    """Tokens tagged (source rank, token index) must arrive sorted by (local expert, source, token)."""
    gen = torch.Generator().manual_seed(7)
    t = 9
    idx_all = torch.rand(world, t, num_experts, generator=gen).topk(top_k, dim=-1).indices
    x = torch.stack([torch.full((t,), float(rank)), torch.arange(t, dtype=torch.float32)], dim=1)
    ok = {}
    for name, d in disps.items():
        recv_x, handle = d.dispatch(x, idx_all[rank], torch.ones(t, top_k))
        per_expert = handle.tokens_per_local_expert
        expert = torch.arange(per_expert.numel()).repeat_interleave(per_expert)
        keys = (expert * world + recv_x[:, 0].long()) * t + recv_x[:, 1].long()
        local = d.local_experts
        want = sum(int((idx_all[s] == e).sum()) for s in range(world) for e in local.tolist())
        ok[name] = bool((keys[1:] > keys[:-1]).all()) and recv_x.shape[0] == want
    return ok


def run_bad_inputs(rank: int, world: int, num_experts: int, top_k: int) -> dict[str, str]:
    """Each bad input must raise on every rank; afterwards the group must still work."""
    topo = Topology(world, 2)
    disp = HierarchicalDispatcher(topo, num_experts)
    seen = {}
    x, w = torch.randn(5, 16), torch.rand(5, top_k)
    idx = torch.zeros(5, top_k, dtype=torch.int64)
    bad_idx = idx.clone()
    if rank == world - 1:
        bad_idx[2, 1] = num_experts  # out of range on one rank only
    bad_x = torch.randn(5, 17) if rank == 1 else x  # hidden size mismatch across ranks
    for label, args in (("out_of_range", (x, bad_idx, w)), ("hidden_mismatch", (bad_x, idx, w))):
        try:
            disp.dispatch(*args)
            seen[label] = "no error"
        except EPInputError as err:
            seen[label] = str(err)
    try:
        Topology(world, 3)
        seen["topology"] = "no error"
    except ValueError as err:
        seen["topology"] = str(err)
    recv_x, handle = disp.dispatch(x, idx, w)  # the group still works after the errors
    seen["after"] = str(torch.allclose(disp.combine(recv_x, handle), x * w.sum(1, keepdim=True), atol=1e-5))
    dist.barrier()
    return seen
