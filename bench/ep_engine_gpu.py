"""EP decode at world size 1 through the dispatcher path against the plain engine, and which fast path
moves the logits agreement (issue 20's ``ep_size=1`` target, issue 10's logits bound), on one model.

    python bench/ep_engine_gpu.py --device cuda --spec reference --batch 256     # the H200 figures
    python bench/ep_engine_gpu.py                                                 # CPU smoke (tiny)

1. Logits, fast path with the reference path's expert choices replayed against the reference path
   (``bench/rollout_gpu.py``'s ``fast_vs_reference_same_routing``) and against a float32 copy, with every
   fast path on, with the elementwise kernels' one-rounding numerics (``set_reference_rounding(False)``,
   the code of 2026-12-01 09:34), and with one fast path switched off at a time (the module-level
   ``*_supported`` hooks replaced for the measurement only, then restored).
2. ``moerl.rollout.Engine`` (CUDA graphs, and eager) against ``moerl.rollout.ep_engine.EPEngine`` over a
   one-rank process group (gloo for the step flags, NCCL for the dispatcher), both dispatchers, with and
   without graphs: B prompts of P tokens, N new tokens at temperature 1, all prefilled in one step,
   ``sync_every=16``, median of ``--runs`` after a warm-up run; tokens/s and the ratio to the engine.
3. The engine with graphs at ``--extra-batches`` (decode points for ``moerl.plan``).
Writes ``<out-dir>/ep_engine_gpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SPECS,
    bench_dtype,
    device_info,
    free_device_memory,
    init_one_rank_group,
    random_prompts,
    rel_err,
    same_weights_pair,
    wall_time,
)
from bench.rollout_gpu import engine_for  # noqa: E402
from bench.rollout_gpu import sampling_requests as _requests  # noqa: E402
from moerl.models import kernels, layers, moe  # noqa: E402
from moerl.models.fast_paths import fast_paths, set_reference_rounding  # noqa: E402
from moerl.rollout import Engine  # noqa: E402
from moerl.rollout.ep_engine import EPEngine  # noqa: E402

_OFF = {  # module attribute -> the hook's "not supported" answer
    "rmsnorm": (layers, "fused_rmsnorm_supported", lambda *a, **k: False),
    "rotary": (layers, "fused_rotary_supported", lambda *a, **k: False),
    "fused_experts": (moe, "fused_experts_supported", lambda *a, **k: False),
    "small_grouped_mm": (kernels, "small_grouped_mm_supported", lambda *a, **k: False),
    "router_bf16_gemm": (moe, "router_logits_from_bf16", lambda *a, **k: None),
}


@contextlib.contextmanager
def _contiguous_rotary():
    """apply_rotary's output made contiguous (does the layout SDPA sees move the logits?)."""
    orig = layers.apply_rotary
    layers.apply_rotary = lambda *a, **k: orig(*a, **k).contiguous()
    try:
        yield
    finally:
        layers.apply_rotary = orig


def rotary_bitwise(device: torch.device) -> dict:
    """Fused rotary (reference rounding) against the eager code on a transposed bf16 q, as attention
    calls it: equal elements and output strides."""
    if device.type != "cuda":
        return {}
    rot = layers.RotaryEmbedding(128, 10000.0, layers.RopeScaling()).to(device)
    q = torch.randn(4, 64, 16, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
    pos = torch.arange(64, device=device)[None].expand(4, 64)
    cos, sin = rot(pos, torch.bfloat16)
    fused = layers.apply_rotary(q, cos, sin)
    with fast_paths(False):
        eager = layers.apply_rotary(q, cos, sin)
    out = {"equal_frac": float((fused == eager).float().mean()), "max_abs": float((fused - eager).abs().max()),
           "fused_strides": list(fused.stride()), "eager_strides": list(eager.stride())}  # fmt: skip
    print(f"rotary fused vs eager: {out}")
    return out


@contextlib.contextmanager
def _without(name: str):
    """Switch one fast path off for a measurement (bench diagnostic; restored on exit)."""
    mod, attr, repl = _OFF[name]
    orig = getattr(mod, attr)
    setattr(mod, attr, repl)
    try:
        yield
    finally:
        setattr(mod, attr, orig)


def logits_ablation(model, vocab: int, device: torch.device) -> dict:
    """Same-routing logits errors of the fast path against the reference path and a float32 copy."""
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(5)).to(device)
    out = {}
    with torch.no_grad():
        with fast_paths(False):
            ref_out = model(ids, return_routed_experts=True)
        ref, routing = ref_out.logits, ref_out.routed_experts
        m32 = copy.deepcopy(model).float()
        exact = m32(ids, forced_experts=routing).logits
        del m32
        free_device_memory(device)
        out["reference_vs_float32"] = rel_err(ref, exact)

        def replay() -> torch.Tensor:
            return model(ids, forced_experts=routing).logits

        variants = [("all fast paths", contextlib.nullcontext)]
        variants.append(("one-rounding elementwise kernels (09:34 code)", _one_rounding))
        variants += [(f"without {n}", lambda n=n: _without(n)) for n in _OFF]
        variants.append(("rotary output contiguous", _contiguous_rotary))
        variants.append(
            ("without rotary, output contiguous", lambda: _stack(_without("rotary"), _contiguous_rotary()))
        )
        for name, ctx in variants:
            with ctx():
                fast = replay()
            out[name] = {"vs_reference": rel_err(fast, ref), "vs_float32": rel_err(fast, exact)}
            print(f"logits same routing, {name:48s}: vs reference {out[name]['vs_reference']:.3e}, "
                  f"vs float32 {out[name]['vs_float32']:.3e}")  # fmt: skip
    print(f"logits same routing, reference vs float32 {out['reference_vs_float32']:.3e}")
    return out


@contextlib.contextmanager
def _one_rounding():
    prev = set_reference_rounding(False)
    try:
        yield
    finally:
        set_reference_rounding(prev)


@contextlib.contextmanager
def _stack(*ctxs):
    with contextlib.ExitStack() as stack:
        for c in ctxs:
            stack.enter_context(c)
        yield


def _time_generate(gen, prompts, new_tokens: int, runs: int, device, tag: str) -> dict:
    outs: list = []
    warm = wall_time(lambda: outs.append(gen(_requests(prompts, new_tokens, 1.0, f"{tag}w"))), device)
    times = [
        wall_time(lambda r=r: outs.append(gen(_requests(prompts, new_tokens, 1.0, f"{tag}{r}_"))), device)
        for r in range(runs)
    ]
    tokens = sum(len(c.token_ids) for c in outs[-1])
    med = statistics.median(times)
    return {
        "seconds": times,
        "median_s": med,
        "warmup_s": warm,
        "tokens": tokens,
        "tokens_per_s": tokens / med,
    }


def _graph_info(engine: Engine) -> dict | None:
    g = getattr(engine, "_graphs", None)
    return None if g is None else {"enabled": g.is_enabled, "graphs": g.num_graphs, "replays": g.num_replays}


def engines(model, prompts, n: int, runs: int, device, extra_batches: list[int], ep: bool = True) -> dict:
    """Plain engine (graphs, eager) and EPEngine at world size 1 (both dispatchers, graphs and eager)."""
    b, p = len(prompts), len(prompts[0])
    res = {}
    for graphs in (True, False) if ep else (True,):
        e = engine_for(model, b, p, n, 16, cuda_graphs=graphs)
        r = _time_generate(e.generate, prompts, n, runs, device, "e")
        r["cuda_graphs"] = _graph_info(e)
        res[f"engine/{'graphs' if graphs else 'eager'}"] = r
        del e
        free_device_memory(device)
    for dispatcher in ("alltoall", "hierarchical") if ep else ():
        e = engine_for(copy.deepcopy(model), b, p, n, 16, cuda_graphs=True)
        ep = EPEngine(e, None, dispatcher=dispatcher)  # world size 1: the dispatcher path, nothing moves
        for graphs in (True, False):
            if not graphs:
                e._graphs = None  # the same engine run eagerly (every step launched from Python)
            r = _time_generate(ep.generate, prompts, n, runs, device, "p")
            r["cuda_graphs"] = _graph_info(e)
            res[f"ep1 {dispatcher}/{'graphs' if graphs else 'eager'}"] = r
        del e, ep
        free_device_memory(device)
    base = res["engine/graphs"]["tokens_per_s"]
    for k, r in res.items():
        r["vs_engine_graphs"] = r["tokens_per_s"] / base
        print(f"decode B={b} {p}+{n} {k:28s}: {r['tokens_per_s']:8.0f} tok/s, x{r['vs_engine_graphs']:.3f} of the "
              f"engine with graphs (graphs {r['cuda_graphs']})")  # fmt: skip
    for bb in extra_batches:
        e = engine_for(model, bb, p, n, 16, cuda_graphs=True)
        r = _time_generate(e.generate, prompts[:bb], n, runs, device, f"x{bb}")
        r["cuda_graphs"] = _graph_info(e)
        res[f"engine/graphs B={bb}"] = r
        print(f"decode B={bb} {p}+{n} engine/graphs: {r['tokens_per_s']:.0f} tok/s")
        del e
        free_device_memory(device)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--batch", type=int, default=None, help="default 256 on CUDA, 4 on CPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 on CUDA, 8 on CPU")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 on CUDA, 8 on CPU")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--extra-batches", type=int, nargs="*", default=[])
    ap.add_argument("--skip-logits", action="store_true")
    ap.add_argument(
        "--skip-ep", action="store_true", help="only the engine with graphs (no eager, no EPEngine)"
    )
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    big = dev.type == "cuda"
    b, p, n = (
        a.batch or (256 if big else 4),
        a.prompt_len or (128 if big else 8),
        a.new_tokens or (128 if big else 8),
    )
    init_one_rank_group(dev, 29547, "cpu:gloo,cuda:nccl" if big else "gloo", 120)
    spec = SPECS[a.spec]
    model = same_weights_pair(spec, dev, bench_dtype(dev))[1]
    free_device_memory(dev)
    try:
        rotary = rotary_bitwise(dev)
        logits = None if a.skip_logits else logits_ablation(model, spec.vocab_size, dev)
        prompts = random_prompts(spec.vocab_size, b, p)
        decode = engines(model, prompts, n, a.runs, dev, a.extra_batches, ep=not a.skip_ep)
    finally:
        dist.destroy_process_group()
    payload = {"benchmark": "ep_engine_gpu", **device_info(dev), "spec": a.spec, "batch": b, "prompt_len": p,
               "new_tokens": n, "runs": a.runs, "rotary_fused_vs_eager": rotary, "logits_same_routing": logits, "decode": decode}  # fmt: skip
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep_engine_gpu.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
