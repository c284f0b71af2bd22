"""Multi-GPU expert parallelism over NCCL: the two dispatchers against a plain all-to-all, and the EP model.

One process per GPU (or per CPU rank, gloo), launched by torchrun:

    python -m torch.distributed.run --nproc-per-node=2 bench/ep_multi_gpu.py --device cuda   # 2 GPUs
    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/ep_multi_gpu.py    # gloo, tiny; 4: 2x2, 1x4

Part 1, dispatch + combine (identity experts: the round trip returns sum_j w_j x_t): R ranks as N simulated
nodes of G (``--ranks-per-node``; default R/2 and R: 2 x 1 and 1 x 2 on two GPUs, so the hierarchical cross-node
stage runs once with traffic and once empty), hidden 7168 and 4096, T = 4096 tokens per rank, top-8 of
E = 256 experts (DeepSeek-V3's routed layer, as ``bench/ep_traffic.py``), bfloat16, contiguous placement.

- Routing ``uniform``: 8 distinct experts uniformly per token; ``zipf``: expert e with probability ~ 1 / (e + 1)
  (Zipf, s = 1), 8 without replacement (Gumbel-top-k, Kool et al. 2019, "Stochastic Beams and Where to Find
  Them", sec. 2); the hot experts sit on rank 0 (at 2 ranks it receives 87% of the copies). Router weights:
  softmax of 8 normals. Every rank draws its own tokens.
- Latency: each iteration starts at a barrier with idle devices; dispatch and combine are timed with
  ``perf_counter`` after a device synchronize (the dispatchers sync the host for split sizes anyway); an
  iteration's time is the slowest rank's; reported: the median over ``--iters`` (>= 20) after ``--warmup``.
- Bandwidth: bytes sent to *other* ranks (the dispatchers' ``Traffic``; rows staying on a rank do not count),
  summed over ranks, over R x latency: mean per-GPU send rate, GB/s (1e9 B), dispatch + combine together.
- Floors: ``floor_a2a`` is ``all_to_all_single`` of the flat dispatcher's bytes (rows of 2H + 4 bytes there,
  2H back) on prebuilt buffers with no index work; ``floor_dedup`` is the same for one row per (token,
  destination rank) (2H + 8k bytes there, 2H back), the bytes a deduplicating dispatcher must move.
  Each dispatcher's first-H uniform round trip is also profiled (host ops by self time, into the JSON).

Part 2, the model (``ModelConfig`` qwen3_moe: hidden 2048, 4 layers, 16 heads of 128, 4 KV heads, 64 experts
top-8 of width 1024, vocabulary 50304, bf16), EP over the R ranks as one node, both dispatchers:
- agreement with EP = 1 (the unparallelized model on the whole batch on the same GPU): relative Frobenius
  error of logits, loss and every gradient, with free routing and with the EP = 1 routing replayed
  (``forced_experts``, as R3 does), so that top-k flips between two bf16 paths do not count; both models
  also against a float32 copy run with the EP = 1 routing (the bf16 noise floor);
- training step (cross-entropy, backward, replicated-gradient all-reduce, fused AdamW) tokens/s, EP = R
  against EP = 1 (the whole model on each GPU, independently);
- decode: one ``moerl.rollout.Engine`` per rank, equal requests and prompt lengths, no stop tokens, so all
  ranks take the same forward steps (each MoE layer is a collective). CUDA graphs are off under EP (a step
  holds host syncs and NCCL calls, which a capture cannot hold); EP = 1 runs with and without them.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc., set before NCCL starts); every collective has the
process group's ``--timeout-s``. Rank 0 writes ``<out-dir>/ep_multi_gpu.json`` after every part.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, print_table, rel_err, write_json  # noqa: E402
from moerl.config import ModelConfig  # noqa: E402
from moerl.ep import AllToAllDispatcher, ExpertPlacement, HierarchicalDispatcher, Topology  # noqa: E402
from moerl.ep.layout import compute_layout, copies_per_rank, send_traffic  # noqa: E402
from moerl.ep.parallelize import parallelize, replicated_parameters  # noqa: E402
from moerl.models.build import arch_from_model_config  # noqa: E402
from moerl.models.model import MoeForCausalLM  # noqa: E402
from moerl.rollout import Engine, Request, SamplingParams  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
DISPATCHERS = {"alltoall": AllToAllDispatcher, "hierarchical": HierarchicalDispatcher}


@dataclass(frozen=True, slots=True)
class Sizes:
    """Problem sizes of one run (``BIG`` on CUDA, ``TINY`` for the gloo smoke run)."""

    tokens: int  # T per rank, dispatch bench
    hiddens: tuple[int, ...]
    num_experts: int  # dispatch bench
    top_k: int
    model: ModelConfig
    vocab: int
    agree_seqs: int  # sequences per rank in the agreement check
    agree_len: int
    train_batch: int  # sequences per rank per training step
    train_len: int
    train_iters: int
    decode_requests: int  # per rank
    prompt_len: int
    new_tokens: int


BIG = Sizes(
    4096, (7168, 4096), 256, 8,
    ModelConfig(family="qwen3_moe", hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=4,
                head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=1024,
                max_position_embeddings=4096, dtype="bfloat16"),
    50304, 2, 512, 8, 1024, 10, 64, 128, 128,
)  # fmt: skip
TINY = Sizes(
    128, (64, 40), 32, 8,
    ModelConfig(family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                num_experts=8, top_k=2, moe_intermediate_size=32, max_position_embeddings=256),
    256, 2, 16, 2, 32, 3, 4, 8, 8,
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Routing, timing, collectives


def draw_routing(
    tokens: int, experts: int, k: int, kind: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx [T, k] int64 (distinct experts per token) and topk_weights [T, k] float32 (rows sum to 1);
    ``kind`` is ``uniform`` or ``zipf`` (p_e ~ 1 / (e + 1), Gumbel-top-k sampling without replacement)."""
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen).clamp_min(1e-20)))
    if kind == "zipf":
        gumbel = gumbel - torch.log(torch.arange(1, experts + 1, dtype=torch.float32))
    elif kind != "uniform":
        raise ValueError(f"routing {kind!r}: choose uniform or zipf")
    idx = gumbel.topk(k, dim=-1).indices
    return idx, torch.randn(tokens, k, generator=gen).softmax(-1)


def time_phases(phases: list[Callable[[], object]], device: torch.device, warmup: int, iters: int) -> list:
    """Run ``phases`` in order ``warmup + iters`` times; returns [iters][phase] milliseconds, each the
    slowest rank's (all-reduce MAX). Every iteration starts at a barrier with the device idle."""
    rows, sync = [], (torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    for i in range(warmup + iters):
        sync()
        dist.barrier()
        sync()
        stamps = [time.perf_counter()]
        for fn in phases:
            fn()
            sync()
            stamps.append(time.perf_counter())
        if i >= warmup:
            rows.append([1e3 * (b - a) for a, b in zip(stamps, stamps[1:], strict=False)])
    t = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over ranks (float64 all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# ----------------------------------------------------------------------------------------------
# Part 1: dispatch + combine


def floor_phases(topo: Topology, rows: list[int], row_bytes: int, back_bytes: int, device) -> tuple:
    """Two ``all_to_all_single`` calls (there: ``rows[d]`` rows of ``row_bytes`` to rank d; back: rows of
    ``back_bytes``) on prebuilt uint8 buffers. Returns (phases, (bytes sent to other ranks, inter-node))."""
    recv = torch.empty(len(rows), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, torch.tensor(rows, dtype=torch.int64, device=device))  # split sizes
    recv_rows = recv.tolist()
    widths = (row_bytes, back_bytes)
    out = [torch.randint(0, 255, (sum(rows), b), dtype=torch.uint8, device=device) for b in widths]
    inn = [torch.empty(sum(recv_rows), b, dtype=torch.uint8, device=device) for b in widths]
    phases = [
        lambda: dist.all_to_all_single(inn[0], out[0], recv_rows, rows),
        lambda: dist.all_to_all_single(out[1], inn[1], rows, recv_rows),
    ]
    me, ranks = dist.get_rank(), list(range(topo.world_size))
    tr = send_traffic(topo, me, ranks, rows, row_bytes) + send_traffic(topo, me, ranks, recv_rows, back_bytes)
    return phases, (tr.intra_node_bytes + tr.inter_node_bytes, tr.inter_node_bytes)


def bench_dispatch(device: torch.device, sizes: Sizes, ranks_per_node: int, args) -> list[dict]:
    """Every (hidden, routing, method) row of one simulated topology; see the module docstring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology(world, ranks_per_node)
    e, k, t = sizes.num_experts, sizes.top_k, sizes.tokens
    disps = {name: cls(topo, e) for name, cls in DISPATCHERS.items()}
    placement = ExpertPlacement(e, topo)
    rows, topo_name = [], f"{topo.num_nodes}x{ranks_per_node}"
    for h in sizes.hiddens:
        for routing in ("uniform", "zipf"):
            gen = torch.Generator().manual_seed(1000 * rank + h + (routing == "zipf"))
            idx, w = draw_routing(t, e, k, routing, gen)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
            idx, w, x = idx.to(device), w.to(device), x.to(device)
            expected = x.float() * w.sum(-1, keepdim=True)  # identity experts: sum_j w_j x_t
            layout = compute_layout(idx, placement)
            methods = {name: _dispatcher_phases(disp, x, idx, w, expected) for name, disp in disps.items()}
            floors = {"floor_a2a": (copies_per_rank(layout, world).tolist(), 2 * h + 4),
                      "floor_dedup": (layout.tokens_per_rank.tolist(), 2 * h + 8 * k)}  # fmt: skip
            for name, (rws, rb) in floors.items():
                phases, sent = floor_phases(topo, rws, rb, 2 * h, device)
                methods[name] = (phases, lambda s=sent: (*s, None))
            for name, (phases, stats) in methods.items():
                ms = time_phases(phases, device, args.warmup, args.iters)
                sent, inter, err = stats()
                is_profiled = routing == "uniform" and name in disps and h == sizes.hiddens[0]
                bytes_all, inter_all = (int(v) for v in all_sum([sent, inter], device))
                total_ms = statistics.median(a + b for a, b in ms)
                rows.append({
                    "topology": topo_name, "hidden": h, "routing": routing,
                    "method": name,
                    "dispatch_ms": statistics.median(m[0] for m in ms),
                    "combine_ms": statistics.median(m[1] for m in ms),
                    "total_ms": total_ms,
                    "bytes_sent_all_ranks": bytes_all,
                    "inter_node_bytes_all_ranks": inter_all,
                    "gb_s_per_gpu": bytes_all / world / (total_ms * 1e-3) / 1e9,
                    "out_rel_err": err, "profile": profile_host(phases, device) if is_profiled else None,
                })  # fmt: skip
    return rows


def profile_host(phases: list, device: torch.device) -> dict:
    """One run of ``phases`` under ``torch.profiler`` (collective): summed kernel time, and the host ops with the
    most self CPU time, in ms. Wall time far above kernel time means the host bounds the dispatcher."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for fn in phases:
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    ev = prof.key_averages()
    top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in ev)
    return {"kernel_ms": kernel_us / 1e3, "top_host_ms": {e.key: e.self_cpu_time_total / 1e3 for e in top}}


def _dispatcher_phases(disp, x, idx, w, expected) -> tuple[list, Callable[[], tuple[int, int, float]]]:
    """Phases (dispatch, combine), and a function giving (bytes sent to other ranks, inter-node, output error)."""
    state: dict = {}

    def dispatch() -> None:
        state["recv"], state["handle"] = disp.dispatch(x, idx, w)
        state["t_dispatch"] = disp.last_traffic

    def combine() -> None:
        state["out"] = disp.combine(state["recv"], state["handle"])
        state["t_combine"] = disp.last_traffic

    def stats() -> tuple[int, int, float]:
        tr = state["t_dispatch"] + state["t_combine"]
        return tr.intra_node_bytes + tr.inter_node_bytes, tr.inter_node_bytes, rel_err(state["out"], expected)

    return [dispatch, combine], stats


# ----------------------------------------------------------------------------------------------
# Part 2: the model


def build_reference(sizes: Sizes, device: torch.device) -> MoeForCausalLM:
    """The unparallelized model, built on ``device`` (seed 0) and made identical on every rank by a
    broadcast from rank 0 (collective)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if sizes.model.dtype == "bfloat16" else torch.float32
    with torch.device(device):
        model = MoeForCausalLM(arch_from_model_config(sizes.model, sizes.vocab))
        model.init_weights()
    model = model.to(dtype).keep_router_buffers_fp32()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    return model


def _ce_sum(model, ids: torch.Tensor, forced=None):
    """Logits [B, T, V], summed next-token cross-entropy (float32), routed experts [B, T, L_moe, k]."""
    out = model(ids, forced_experts=forced, return_routed_experts=True)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    return out.logits, ce, out.routed_experts


def _grads_of(model, ids: torch.Tensor, num_tokens: int, forced=None) -> tuple:
    """Forward + backward of the summed CE over ``num_tokens``: (logits, loss sum, routed experts, {name: grad})."""
    model.zero_grad(set_to_none=True)
    logits, loss, routed = _ce_sum(model, ids, forced)
    (loss / num_tokens).backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), routed, grads


def _compare(logits, grads: dict, ref_logits, ref_grads: dict, device: torch.device) -> dict:
    """Relative Frobenius error of the logits (all ranks together) and of each gradient (max, median)."""
    diff, want = (logits.double() - ref_logits.double()).square().sum(), ref_logits.double().square().sum()
    sq = all_sum([float(diff), float(want)], device)
    errs = {n: rel_err(g, ref_grads[n]) for n, g in grads.items()}
    worst = max(errs, key=errs.get)
    return {"logits_rel_err": (sq[0] / sq[1]) ** 0.5, "grad_rel_err_max": errs[worst], "grad_worst": worst,
            "grad_rel_err_median": statistics.median(errs.values())}  # fmt: skip


def _shard_like(full: dict, local: dict) -> dict:
    """Full-model gradients cut to one EP rank's view: expert tensors indexed by its local expert ids."""
    return {n: g[local[n]] if n in local else g for n, g in full.items()}


def agreement(ref: MoeForCausalLM, disp, sizes: Sizes, device: torch.device) -> dict:
    """EP model vs ``ref`` (EP = 1, same GPU) on a global batch, free and replayed routing; both also vs a
    float32 copy of ``ref`` run with ``ref``'s routing (the bf16 noise floor)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, sizes.vocab, (sizes.agree_seqs * world, sizes.agree_len), generator=gen).to(device)
    mine, num_tokens = slice(rank, None, world), ids[:, 1:].numel()
    ref_logits, ref_loss, ref_routed, ref_grads = _grads_of(ref, ids, num_tokens)
    logits32, _, _, grads32 = _grads_of(copy.deepcopy(ref).float(), ids, num_tokens, ref_routed)
    out = {"ep1_vs_fp32": _compare(ref_logits, ref_grads, logits32, grads32, device)}
    for mode in ("free", "replayed"):
        model = parallelize(copy.deepcopy(ref), dispatcher=disp)
        forced = ref_routed[mine] if mode == "replayed" else None
        logits, loss, routed, grads = _grads_of(model, ids[mine], num_tokens, forced)
        replicated = dict(replicated_parameters(model))
        for name in replicated:
            dist.all_reduce(grads[name])  # data-parallel sum; expert gradients are complete on their rank
        local = {
            n: model.get_submodule(n.rsplit(".", 1)[0]).local_expert_ids for n in grads if n not in replicated
        }
        total, same, count = all_sum(
            [float(loss), float((routed == ref_routed[mine]).sum()), routed.numel()], device
        )
        out[mode] = {
            "loss_rel_err": abs(total - float(ref_loss)) / abs(float(ref_loss)),
            "routing_agreement": same / count,  # fraction of (token, layer, slot) expert choices equal
            **_compare(logits, grads, ref_logits[mine], _shard_like(ref_grads, local), device),
            "vs_fp32": _compare(logits, grads, logits32[mine], _shard_like(grads32, local), device),
        }  # fmt: skip
    return out


def train_throughput(ref: MoeForCausalLM, disp, sizes: Sizes, device: torch.device) -> dict:
    """Tokens/s of a training step (CE, backward, all-reduce of replicated gradients under EP, AdamW)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(ref).train()
    if disp is not None:
        model = parallelize(model, dispatcher=disp)
    replicated = [p for _, p in replicated_parameters(model)] if disp is not None else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, sizes.vocab, (sizes.train_batch, sizes.train_len), generator=gen).to(device)
    ep = world if disp is not None else 1
    global_tokens = ep * ids[:, 1:].numel()

    def step() -> None:
        _, loss, _ = _ce_sum(model, ids)
        (loss / global_tokens).backward()
        for p in replicated:  # data-parallel gradient sum; expert gradients are complete on their rank
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    med = statistics.median(m[0] for m in time_phases([step], device, 2, sizes.train_iters))
    per_gpu = ids.numel() / (med * 1e-3)
    return {"ep": ep, "step_ms": med, "tokens_per_s_per_gpu": per_gpu, "tokens_per_s": ep * per_gpu}


def decode_throughput(ref, disp, sizes: Sizes, device: torch.device, graphs: bool) -> dict:
    """Generation tokens/s of one ``Engine`` per rank (B requests of P prompt tokens, N new tokens each,
    temperature 1, no stop tokens, all prompts prefilled in one step); wall time includes the prefill."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(ref).eval()
    if disp is not None:
        model = parallelize(model, dispatcher=disp)
    b, p, n = sizes.decode_requests, sizes.prompt_len, sizes.new_tokens
    engine = Engine(model, max_slots=b, kv_token_budget=b * (p + n), max_seq_len=p + n,
                    max_prefill_tokens=b * p, sync_every=16 if device.type == "cuda" else 1,
                    cuda_graphs=graphs)  # fmt: skip
    gen = torch.Generator().manual_seed(200 + rank)
    prompts = torch.randint(0, sizes.vocab, (b, p), generator=gen).tolist()

    def run() -> None:
        reqs = [Request(request_id=f"r{i}", prompt_ids=q,
                        params=SamplingParams(temperature=1.0, max_new_tokens=n, seed=i))
                for i, q in enumerate(prompts)]  # fmt: skip
        assert all(len(c.token_ids) == n for c in engine.generate(reqs))  # every rank took the same steps

    ms = statistics.median(m[0] for m in time_phases([run], device, 1, 3))  # the warm-up run captures graphs
    ep = world if disp is not None else 1
    per_gpu = b * n / (ms * 1e-3)
    return {"ep": ep, "cuda_graphs": graphs, "generate_ms": ms, "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s": ep * per_gpu}  # fmt: skip


def bench_model(device: torch.device, sizes: Sizes, payload: dict, save: Callable[[], None]) -> None:
    """Part 2 (module docstring): agreement, training and decode, each dispatcher; saves after each."""
    world = dist.get_world_size()
    topo = Topology(world, world)  # the GPUs of one host: one node
    ref = build_reference(sizes, device)
    disps = {name: cls(topo, sizes.model.num_experts) for name, cls in DISPATCHERS.items()}
    payload["model"] = {"config": {"vocab": sizes.vocab, **dataclasses.asdict(sizes.model)},
                        "topology": f"{topo.num_nodes}x{topo.ranks_per_node}", "agreement": {}}  # fmt: skip
    for name, disp in disps.items():
        payload["model"]["agreement"][name] = agreement(ref, disp, sizes, device)
        save()
    train = payload["model"]["train"] = {}
    for name, disp in {"ep1": None, **disps}.items():
        train[name] = train_throughput(ref, disp, sizes, device)
        save()
    runs = {"ep1_graphs": (None, True), "ep1": (None, False), **{n: (d, False) for n, d in disps.items()}}
    decode = payload["model"]["decode"] = {}
    for name, (disp, graphs) in runs.items():
        decode[name] = decode_throughput(ref, disp, sizes, device, graphs)
        save()


# ----------------------------------------------------------------------------------------------
# Driver


def print_tables(payload: dict) -> None:
    rows = payload.get("dispatch", [])
    a2a = {(r["topology"], r["hidden"], r["routing"]): r["total_ms"] for r in rows if r["method"] == "alltoall"}  # fmt: skip
    print_table(
        f"EP dispatch + combine, {payload['world_size']} ranks, {payload['device']}",
        ["nodes x G", "H", "routing", "method", "disp ms", "comb ms", "total ms", "MB sent/rank", "GB/s/GPU", "vs a2a", "rel err"],
        [[r["topology"], r["hidden"], r["routing"], r["method"], r["dispatch_ms"], r["combine_ms"], r["total_ms"],
          r["bytes_sent_all_ranks"] / payload["world_size"] / 1e6, r["gb_s_per_gpu"],
          r["total_ms"] / a2a[(r["topology"], r["hidden"], r["routing"])], r["out_rel_err"]] for r in rows],
    )  # fmt: skip
    for r in (r for r in rows if r["profile"]):
        print(f"profile {r['topology']} {r['method']}: kernels {r['profile']['kernel_ms']:.2f} ms")
    m = payload.get("model", {})
    row = lambda label, v: [label, v["logits_rel_err"], v.get("loss_rel_err"), v.get("routing_agreement"),  # noqa: E731
                            v["grad_rel_err_max"], v["grad_worst"], v["grad_rel_err_median"]]  # fmt: skip
    agree = [row("ep1 vs fp32", a["ep1_vs_fp32"]) for a in list(m.get("agreement", {}).values())[:1]]
    for n, a in m.get("agreement", {}).items():
        agree += [row(f"{n}/{mode} vs {ref}", a[mode] if ref == "ep1" else a[mode]["vs_fp32"])
                  for mode in ("free", "replayed") for ref in ("ep1", "fp32")]  # fmt: skip
    print_table("EP model agreement (relative errors)",
                ["run vs reference", "logits", "loss", "routing equal", "grad max", "worst", "grad median"], agree)  # fmt: skip
    thr = [[part, n, v["ep"], v.get("cuda_graphs", "-"), v["tokens_per_s"], v["tokens_per_s_per_gpu"]]
           for part in ("train", "decode") for n, v in m.get(part, {}).items()]  # fmt: skip
    print_table("EP model throughput", ["part", "run", "EP", "graphs", "tok/s", "tok/s/GPU"], thr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out-dir", default=None, help="default bench/results")
    ap.add_argument("--ranks-per-node", default=None, help="simulated G values, comma list; default R/2,R")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per dispatch row (>= 20)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="timeout of every collective")
    args = ap.parse_args(argv)
    os.environ.update(MULTICAST_OFF)  # NVLink multicast off, before NCCL starts (init_process_group below)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout_s)  # of every collective, NCCL and gloo
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = BIG if cuda else TINY
    gs = sorted({int(g) for g in args.ranks_per_node.split(",")} if args.ranks_per_node else {max(1, world // 2), world})  # fmt: skip
    payload = {
        "benchmark": "ep_multi_gpu", **device_info(device), "world_size": world,
        "backend": dist.get_backend(), "env": {k: os.environ.get(k) for k in MULTICAST_OFF},
        "dispatch_config": {"tokens_per_rank": sizes.tokens, "hiddens": sizes.hiddens, "experts": sizes.num_experts,
                            "top_k": sizes.top_k, "dtype": "bfloat16", "iters": args.iters, "warmup": args.warmup},
        "dispatch": [],
    }  # fmt: skip

    def save() -> None:
        if rank == 0:
            path = write_json("ep_multi_gpu", payload, args.out_dir)
            print(f"{time.strftime('%H:%M:%S')} wrote {path}", flush=True)

    try:
        for g in gs:
            payload["dispatch"] += bench_dispatch(device, sizes, g, args)
            save()
        if not args.skip_model:
            bench_model(device, sizes, payload, save)
        if rank == 0:
            print_tables(payload)
    except BaseException:
        payload["error"] = traceback.format_exc()
        save()
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
