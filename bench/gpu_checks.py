"""Correctness of the CUDA fast paths at small sizes, on fresh random inputs (CI has no GPU, so this is the
GPU half of tests/unit/test_bench_fastpaths.py; bench/gpu_suite.sh runs it first).

    python bench/gpu_checks.py --device cuda

Each check compares a fast path with the eager reference and with a float32 (or float64) reference by
||out - ref|| / ||ref|| (METHOD.md); outputs are poisoned with NaN first where the kernel writes into a
buffer. Prints one line per check and exits non-zero when any fails.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SPECS, build_hf, moerl_from_hf, rel_err  # noqa: E402
from moerl.ep import AllToAllDispatcher, EPInputError, HierarchicalDispatcher, Topology  # noqa: E402
from moerl.ep import rows as ep_rows  # noqa: E402
from moerl.models import kernels, layer_kernels, moe_kernels  # noqa: E402
from moerl.models.config import RopeScaling  # noqa: E402
from moerl.models.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402
from moerl.models.moe import Experts, route  # noqa: E402
from moerl.rollout.cuda_graphs import GraphRunner  # noqa: E402

FAILED: list[str] = []


def check(name: str, err: float, tol: float) -> None:
    ok = err < tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(name)


def check_rmsnorm(device: torch.device) -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        for d, rows in ((2048, 300), (128, 4099)):
            norm = RMSNorm(d, 1e-6).to(device, dtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.3 * torch.randn(d, device=device))
            x = (3 * torch.randn(rows, d, device=device)).to(dtype).requires_grad_(True)
            dy = torch.randn(rows, d, device=device, dtype=dtype)
            with kernels.fast_paths(False):
                ref = norm(x)
            gx_ref, gw_ref = torch.autograd.grad(ref, [x, norm.weight], dy)
            out = layer_kernels.fused_rmsnorm(x, norm.weight, 1e-6)
            gx, gw = torch.autograd.grad(out, [x, norm.weight], dy)
            tag = f"rmsnorm {dtype} D={d}"
            check(f"{tag} out", rel_err(out, ref), tol)
            check(f"{tag} grad_x", rel_err(gx, gx_ref), tol)
            check(f"{tag} grad_w", rel_err(gw, gw_ref), tol)


def check_rotary(device: torch.device) -> None:
    rot = RotaryEmbedding(128, 10000.0, RopeScaling()).to(device)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        for b, t in ((3, 257), (256, 1)):  # prefill/training and decode shapes
            pos = torch.randint(0, 4000, (b, t), device=device)
            cos, sin = rot(pos, dtype)
            x = torch.randn(b, t, 16, 128, device=device).to(dtype).transpose(1, 2).requires_grad_(True)
            x64 = x.detach().double().requires_grad_(True)
            ref = apply_rotary(x64, cos.double(), sin.double())
            g = torch.randn(ref.shape, device=device, dtype=torch.float64)
            (d_ref,) = torch.autograd.grad(ref, x64, g)
            check(
                "rotary supported",
                0.0 if layer_kernels.fused_rotary_supported(x, cos, sin, False) else 1.0,
                0.5,
            )
            out = layer_kernels.fused_rotary(x, cos, sin)
            (d,) = torch.autograd.grad(out, x, g.to(dtype))
            check(f"rotary {dtype} B={b} T={t} out vs float64", rel_err(out, ref), tol)
            check(f"rotary {dtype} B={b} T={t} grad vs float64", rel_err(d, d_ref), tol)


def check_swiglu(device: torch.device) -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        gu = torch.randn(3000, 2 * 1000, device=device).to(dtype).requires_grad_(True)
        g, u = gu.double().chunk(2, dim=-1)
        ref = torch.nn.functional.silu(g) * u
        da = torch.randn(ref.shape, device=device, dtype=torch.float64)
        (d_ref,) = torch.autograd.grad(ref, gu, da)
        out = kernels.swiglu(gu)
        (d,) = torch.autograd.grad(out, gu, da.to(dtype))
        check(f"swiglu {dtype} out vs float64", rel_err(out, ref), tol)
        check(f"swiglu {dtype} grad vs float64", rel_err(d, d_ref), tol)


def check_weighted_swiglu(device: torch.device) -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        gu = torch.randn(3000, 2 * 1024, device=device).to(dtype).requires_grad_(True)
        w = torch.rand(3000, device=device, requires_grad=True)
        g, u = gu.double().chunk(2, dim=-1)
        w64 = w.detach().double().requires_grad_(True)
        ref = torch.nn.functional.silu(g) * u * w64[:, None]
        da = torch.randn(ref.shape, device=device, dtype=torch.float64)
        d_ref = torch.autograd.grad(ref, [gu, w64], da)
        out = kernels.swiglu(gu, w)
        d = torch.autograd.grad(out, [gu, w], da.to(dtype))
        check(f"weighted swiglu {dtype} out vs float64", rel_err(out, ref), tol)
        check(f"weighted swiglu {dtype} grad gu vs float64", rel_err(d[0], d_ref[0]), tol)
        check(f"weighted swiglu {dtype} grad w vs float64", rel_err(d[1], d_ref[1]), tol)


def check_ep_rows(device: torch.device) -> None:
    """moerl.ep.rows kernels against their tensor-op paths (run on CPU copies), fresh random inputs."""
    for dtype in (torch.float32, torch.bfloat16):
        h, na, nb, t, k = 2048, 3000, 1000, 600, 8
        a = torch.randn(na, h, device=device).to(dtype)
        b = torch.randn(nb, h, device=device).to(dtype)
        src = torch.randint(0, na + nb, (5000,), device=device)
        cpu = [z.cpu() for z in (a, b, src)]
        check(
            f"rows gather2 {dtype}",
            rel_err(ep_rows.gather_rows2(a, b, src), ep_rows.gather_rows2(*cpu)),
            1e-7,
        )
        sc = torch.rand(na + nb, device=device)
        got = ep_rows.gather_rows2(a, b, src, scale=sc, out_dtype=torch.float32)
        want = ep_rows.gather_rows2(*cpu, scale=sc.cpu(), out_dtype=torch.float32)
        check(f"rows gather2 scaled {dtype}", rel_err(got, want), 1e-6)
        slots = torch.cat([torch.randperm(na + nb), torch.full((t * k - na - nb,), -1)])
        pos = slots[torch.randperm(t * k)].view(t, k).to(device)
        w = torch.rand(t, k, device=device)
        ref = ep_rows.gather_sum2(a.cpu(), b.cpu(), pos.cpu(), w.cpu())
        check(f"rows gather_sum2 {dtype}", rel_err(ep_rows.gather_sum2(a, b, pos, w), ref), 1e-6)
        ref = ep_rows.gather_sum2(a.cpu(), b.cpu(), pos.cpu())
        check(f"rows gather_sum2 unweighted {dtype}", rel_err(ep_rows.gather_sum2(a, b, pos), ref), 1e-6)
        g = torch.randn(t, h, device=device)
        got = ep_rows.gather_sum2_backward(g, a, b, pos, w)
        want = ep_rows.gather_sum2_backward(g.cpu(), a.cpu(), b.cpu(), pos.cpu(), w.cpu())
        for name, x, y in zip(("a", "b", "w"), got, want, strict=True):
            check(f"rows gather_sum2 backward grad_{name} {dtype}", rel_err(x, y), 1e-5)
    x = torch.randn(512, 2048, device=device, dtype=torch.bfloat16)
    q, scale = ep_rows.quantize_rows_fp8(x)
    back = ep_rows.gather_rows2(
        q, q[:0], torch.arange(512, device=device), scale=scale, out_dtype=torch.bfloat16
    )
    check("fp8 per-row quantize + dequantizing gather", rel_err(back, x), 6e-2)
    for h in (2048, 7168, 100):
        x = (
            torch.randn(300, h, device=device, dtype=torch.bfloat16)
            * torch.logspace(-2, 2, 300, device=device)[:, None]
        )
        x[3] = 0
        q, scale = ep_rows.quantize_rows_fp8(x)
        q_ref, s_ref = ep_rows.quantize_rows_fp8(x.cpu())
        check(f"fp8 quantize kernel scales vs tensor ops H={h}", rel_err(scale, s_ref), 1e-6)
        check(f"fp8 quantize kernel values vs tensor ops H={h}", rel_err(q.float(), q_ref.float()), 2e-2)


def check_single_rank_layout(device: torch.device) -> None:
    """``rows.single_rank_layout`` (two Triton kernels) against its tensor-op path on CPU copies: every
    output exact, with -1 and out-of-range ids mixed in, a non-identity local order, several sizes."""
    for t, k, e in ((4096, 8, 64), (777, 6, 160), (5, 2, 3), (1, 1, 1)):
        idx = torch.randint(0, e, (t, k), device=device)
        if t > 5:
            idx[torch.rand(t, k, device=device) < 0.05] = -1
            idx[0, 0], idx[1, 0] = e + 3, -7  # out of range: sorted last, reported in info
        w = torch.rand(t, k, device=device)
        local = torch.randperm(e, device=device)
        got = ep_rows.single_rank_layout(idx, w, local, e)
        want = ep_rows.single_rank_layout(idx.cpu(), w.cpu(), local.cpu(), e)
        names = ("order", "row_token", "slot_row", "row_weight", "counts", "info")
        bad = [n for n, x, y in zip(names, got, want, strict=True) if not torch.equal(x.cpu(), y.to(x.dtype))]
        check(f"single_rank_layout == sort reference t={t} k={k} E={e} {bad}", float(len(bad)), 0.5)


def check_single_rank_dispatch(device: torch.device) -> None:
    """Both dispatchers in a group of one rank (gloo: no collective runs at world size 1) on the device
    against the same dispatcher on CPU copies: recv_x, counts, received weights, combine and the
    gradients of x and the weights, for calls of different M back to back (the pinned read buffer is
    reused), then out-of-range ids (EPInputError) and a valid call after them."""
    made = not dist.is_initialized()
    if made:
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
    for cls in (AllToAllDispatcher, HierarchicalDispatcher):
        gpu, cpu = cls(Topology(1, 1), 16), cls(Topology(1, 1), 16)
        for t, k, empty in ((300, 4, 0.0), (129, 4, 0.3), (1000, 2, 0.6)):
            idx = torch.randint(0, 16, (t, k))
            idx[torch.rand(t, k) < empty] = -1
            x, w, dy = torch.randn(t, 64), torch.rand(t, k), torch.randn(t, 64)
            res = []
            for disp, dev in ((gpu, device), (cpu, torch.device("cpu"))):
                xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
                recv_x, handle = disp.dispatch(xd, idx.to(dev), wd)
                counts = handle.tokens_per_local_expert
                out = disp.combine(recv_x * 2, handle)
                gx, gw = torch.autograd.grad(out, [xd, wd], dy.to(dev))
                res.append([recv_x, counts, handle.recv_weights, out, gx, gw])
            bad = sum(  # the row moves and the plan are exact; sums may differ in float32 order only
                tuple(a.shape) != tuple(b.shape) or not torch.equal(a.detach().cpu(), b.detach())
                for a, b in zip(res[0][:3], res[1][:3], strict=True)
            )
            check(f"single-rank {cls.__name__} rows, counts, weights exact t={t} k={k} empty={empty}",
                  float(bad), 0.5)  # fmt: skip
            for name, a, b in zip(("combine", "grad x", "grad w"), res[0][3:], res[1][3:], strict=True):
                check(f"single-rank {cls.__name__} {name} t={t} k={k} empty={empty}", rel_err(a, b), 1e-6)
        idx = torch.randint(0, 16, (50, 2), device=device)
        idx[7, 1] = 16
        try:
            gpu.dispatch(torch.randn(50, 64, device=device), idx, torch.rand(50, 2, device=device))
            raised = False
        except EPInputError:
            raised = True
        recv_x, handle = gpu.dispatch(torch.randn(50, 64, device=device), idx.clamp(max=15),
                                      torch.rand(50, 2, device=device))  # fmt: skip
        counts = handle.tokens_per_local_expert
        ok = raised and recv_x.shape[0] == 100 and int(counts.sum()) == 100
        check(f"single-rank {cls.__name__} out-of-range ids raise, next call right", 0.0 if ok else 1.0, 0.5)
    if made:
        dist.destroy_process_group()


def check_reference_rounding(device: torch.device) -> None:
    """With reference rounding (the default) the rotary and SwiGLU forward kernels equal the eager bf16 code
    element for element (same roundings; SiLU's exp may differ in the last float32 bit, hence < 1)."""
    rot = RotaryEmbedding(128, 10000.0, RopeScaling()).to(device)
    q = torch.randn(4, 64, 16, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = rot(torch.arange(64, device=device)[None].expand(4, 64), torch.bfloat16)
    fused = layer_kernels.fused_rotary(q, cos, sin)
    with kernels.fast_paths(False):
        eager = apply_rotary(q, cos, sin)
    check("rotary (reference rounding) elements != eager bf16", float((fused != eager).float().mean()), 1e-4)
    gu = torch.randn(4096, 2048, device=device, dtype=torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)
    same = kernels.swiglu(gu) == torch.nn.functional.silu(g) * u
    check("swiglu (reference rounding) elements != eager bf16", float((~same).float().mean()), 1e-2)


def check_routing(device: torch.device) -> None:
    """expert_layout's counting sort, fused_route and the bf16 router GEMM against their references."""
    for n, k, e in ((2048 // 8, 8, 64), (16384, 8, 64), (1000, 6, 160)):
        idx = torch.randint(0, e, (n, k), device=device)
        w = torch.rand(n, k, device=device)
        got = moe_kernels.expert_layout(idx, w, e)
        want = moe_kernels._expert_layout_reference(idx, w, e)
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        check(f"expert_layout == sort reference n={n} k={k} E={e}", 0.0 if same else 1.0, 0.5)
        logits = torch.randn(n, e, device=device)
        with torch.no_grad():
            fi, fw = moe_kernels.fused_route(logits, k, True)
            with kernels.fast_paths(False):
                r = route(logits, top_k=k, norm_topk_prob=True)
        check(
            f"fused_route ids == eager n={n} E={e} (fraction differing)",
            float((fi != r.topk_idx).float().mean()),
            1e-3,
        )
        check(f"fused_route weights n={n} E={e}", rel_err(fw, r.topk_weights), 1e-5)
    x = torch.randn(4096, 2048, device=device).to(torch.bfloat16)
    wt = (0.02 * torch.randn(64, 2048, device=device)).to(torch.bfloat16)
    with torch.no_grad():
        got = moe_kernels.router_logits_from_bf16(x, wt)
        want = torch.nn.functional.linear(x.float(), wt.float())
    check("router logits bf16 GEMM -> float32 available", 0.0 if got is not None else 1.0, 0.5)
    if got is not None:
        check("router logits bf16 GEMM vs float32 GEMM", rel_err(got, want), 1e-5)


def check_causal_attention(device: torch.device) -> None:
    """The model's no-padding path (SDPA is_causal) against the explicit causal mask."""
    hf = build_hf(SPECS["tiny"], device, torch.bfloat16, seed=0)
    model = moerl_from_hf(hf, device, torch.bfloat16)
    del hf
    ids = torch.randint(0, 256, (3, 100), device=device)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        fast = model(ids, ones).logits  # no padding: is_causal
        pad = ones.clone()
        pad[0, 0] = 0  # one padding token: the explicit causal + padding mask for the whole batch
        masked = model(ids, pad).logits
    check("causal fast path vs explicit mask (rows without padding)", rel_err(fast[1:], masked[1:]), 2e-2)


def check_experts(device: torch.device) -> None:
    n, h, i, e, k = 1000, 256, 128, 16, 4
    ex = Experts(e, h, i).to(device, torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.05)
        ex.down_proj.normal_(0, 0.05)
    x = torch.randn(n, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    w, idx = torch.randn(n, e, device=device).softmax(-1).topk(k, dim=-1)
    w = w.clone().requires_grad_(True)
    ex32 = Experts(e, h, i).to(device, torch.float64)
    with torch.no_grad():
        ex32.gate_up_proj.copy_(ex.gate_up_proj)
        ex32.down_proj.copy_(ex.down_proj)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = ex32(x64, idx, w64)
    dy = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, [x64, w64, ex32.gate_up_proj, ex32.down_proj], dy)
    out = kernels.fused_experts(x, idx, w, ex.gate_up_proj, ex.down_proj)
    g = torch.autograd.grad(out, [x, w, ex.gate_up_proj, ex.down_proj], dy.to(torch.bfloat16))
    check("fused_experts out vs float64", rel_err(out, ref), 1e-2)
    for name, a, b in zip(("x", "w", "gate_up", "down"), g, g_ref, strict=True):
        check(f"fused_experts grad_{name} vs float64", rel_err(a, b), 1e-2)
    with kernels.fast_paths(False):
        eager = ex(x, idx, w)
    check("fused_experts vs eager Experts (bf16)", rel_err(out, eager), 1e-2)
    order, inverse, offsets = kernels.expert_order_no_sync(idx, e)
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    check("expert offsets == cumsum(bincount)", float((offsets.long() - counts.cumsum(0)).abs().sum()), 0.5)
    check(
        "inverse o order == identity",
        float((inverse[order] - torch.arange(n * k, device=device)).abs().sum()),
        0.5,
    )


def check_graph_runner(device: torch.device) -> None:
    a = torch.randn(64, device=device)
    runner = GraphRunner(device)

    def fn():
        return (a * 2 + 1,)

    first = runner.run("k", fn)[0]
    a.copy_(torch.randn(64, device=device))
    second = runner.run("k", fn)[0]
    check("graph replay sees new inputs", rel_err(second, a * 2 + 1), 1e-6)
    check("graph outputs are copies", rel_err(first, second) if runner.num_graphs else 1.0, float("inf"))
    check("one graph captured, two replays", abs(runner.num_graphs - 1) + abs(runner.num_replays - 2), 0.5)


def check_overlap_sync(device: torch.device) -> None:
    """The engines with the host sync overlapped (``overlap_sync``: pinned copy, event, the next decode
    enqueued before the host reads) against the same engines syncing in place, float32, CUDA graphs on:
    completions whose tokens differ (must be 0) and the largest log-prob difference."""
    from moerl.config import ModelConfig
    from moerl.models import build_model
    from moerl.rollout import Engine, Request, SamplingParams

    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(ModelConfig(max_position_embeddings=128, device=str(device)), 61).eval()
    with torch.no_grad():  # O(1) weights: decisive logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, device=device) / p.shape[-1] ** 0.5)
    gen = torch.Generator().manual_seed(3)
    reqs = [
        Request(
            request_id=f"r{i}",
            prompt_ids=torch.randint(0, 61, (5 + 3 * i,), generator=gen).tolist(),
            params=SamplingParams(
                temperature=1.0, max_new_tokens=(2, 12, 30, 20)[i], n=4, seed=i, stop_token_ids=(3, 17)
            ),
        )
        for i in range(4)
    ]
    makers = {
        "slots": lambda o: Engine(model, max_slots=8, kv_token_budget=8 * 64, sync_every=4, overlap_sync=o),
        "paged": lambda o: Engine(
            model,
            cache="paged",
            max_slots=12,
            kv_token_budget=120,
            block_size=4,
            sync_every=4,
            overlap_sync=o,
        ),
    }
    for kind, make in makers.items():
        ref, out = make(False).generate(reqs), make(True).generate(reqs)
        check(
            f"overlap_sync {kind}: completions with other tokens",
            sum(a.token_ids != b.token_ids for a, b in zip(ref, out, strict=True)),
            0.5,
        )
        pairs = [
            (x, y)
            for a, b in zip(ref, out, strict=True)
            for x, y in zip(a.logprobs, b.logprobs, strict=False)
        ]
        diff = max(abs(x - y) for x, y in pairs)  # lengths differ only where tokens do (counted above)
        check(f"overlap_sync {kind}: log-prob max |diff|", diff, 1e-4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default=None, help="unused (uniform bench arguments)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    check_rmsnorm(device)
    check_swiglu(device)
    check_weighted_swiglu(device)
    check_ep_rows(device)
    check_single_rank_layout(device)
    check_single_rank_dispatch(device)
    check_routing(device)
    check_causal_attention(device)
    check_rotary(device)
    check_reference_rounding(device)
    check_experts(device)
    check_graph_runner(device)
    check_overlap_sync(device)
    print(f"gpu_checks: {len(FAILED)} failed {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
