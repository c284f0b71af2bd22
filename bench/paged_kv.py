"""Slot vs paged KV cache at the same KV memory, on long-tailed response lengths with groups of 8.

    python bench/paged_kv.py                                                   # CPU: tiny model, scaled down
    python bench/paged_kv.py --device cuda --dtype bfloat16 --config reference \
        --prompts 64 --prompt-len 512 --median-new 300 --max-new 8192 --kv-slots 64 --max-slots 512 \
        --sync-every 8                                                          # the issue's GPU sizes

Workload: ``--prompts`` random prompts of ``--prompt-len`` tokens, each a request of ``--group`` samples
(one GRPO group; sampled, no stop tokens). A group's response length is drawn from a lognormal with median
``--median-new`` and 1% of groups at ``--max-new`` or more (sigma = ln(max / median) / 2.326), capped at
``--max-new``; lengths are per group (a request has one ``max_new_tokens``).

Same memory: both engines get ``kv_token_budget = --kv-slots x (prompt-len + max-new)`` tokens. The slot
engine must size each slot for the longest sequence, so it decodes at most ``--kv-slots`` sequences
together; the paged engine decodes up to ``--max-slots`` together, admitting by free blocks and
preempting when they run out. Both run in one process on the same weights; the table gives tokens/s,
the mean number of sequences decoding together, prefill vs prefix-hit tokens, preemptions, and how many
completions are token-identical between the two (all in float32; bfloat16 may diverge late).
``--buckets engine`` rounds decode batches as each engine does in runs (``graph_batch_buckets``) instead
of to powers of two; ``--kernel-profile STEPS`` adds a pass with per-kernel device times around those decode
steps (``kernel_profile``); ``--busy`` a pass with device events around each launch (device busy vs waiting
for the host, ``busy_pass``). ``bench/paged_tail_call.sh`` is the device call of the GPU figures.
Writes ``bench/results/paged_kv.json`` atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

from moerl.atomic import atomic_write_text
from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import Engine, Request, SamplingParams

CONFIGS = {
    "tiny": dict(vocab=256, model=ModelConfig(max_position_embeddings=1024)),
    # OLMoE-sized Qwen3-MoE of the one-GPU performance issue (bench/rollout.py's "reference").
    "reference": dict(
        vocab=50304,
        model=ModelConfig(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            num_experts=64,
            top_k=8,
            moe_intermediate_size=1024,
            max_position_embeddings=16384,
        ),
    ),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def response_lengths(n: int, median: int, longest: int, seed: int) -> list[int]:
    """``n`` lognormal lengths: median ``median``, 1% at ``longest`` or more, capped to [1, longest]."""
    sigma = math.log(longest / median) / 2.326 if longest > median else 0.0
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(n, generator=gen, dtype=torch.float64))
    return [int(min(max(round(x), 1), longest)) for x in draws.tolist()]


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    return group_requests(prompts, args)


def group_requests(prompts: list[list[int]], args: argparse.Namespace) -> list[Request]:
    """One request of ``args.group`` samples a prompt, at temperature 1, each with its response length
    (``response_lengths``: median ``args.median_new``, long tail to ``args.max_new``)."""
    lengths = response_lengths(len(prompts), args.median_new, args.max_new, args.seed + 1)
    return [
        Request(
            request_id=f"g{i}",
            prompt_ids=p,
            params=SamplingParams(temperature=1.0, max_new_tokens=n, n=args.group, seed=args.seed + i),
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]


def parse_device(p: argparse.ArgumentParser, text: str, cuda_hint: str = "") -> torch.device:
    """``--device``: cpu or cuda (one usable here), else ``p.error`` (one line, exit 2)."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        p.error(f"--device {text!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {text!r}: cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: no CUDA device here{cuda_hint}")
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pow2_buckets(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``n``, then ``n`` (``--buckets pow2``)."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return (*out, n)


def _graph_captures(engine: Engine) -> int | None:
    graphs = getattr(engine, "_graphs", None)
    return None if graphs is None else graphs.num_captures


def run(engine: Engine, requests: list[Request], device: torch.device) -> tuple[dict, list]:
    """Generate ``requests`` (after a short warm-up) and return the figures and the completions."""
    first = requests[0]  # warm-up on a prompt no request shares (no prefix hit carried into the run)
    warm = Request(
        request_id="warm",
        prompt_ids=first.prompt_ids[::-1],
        params=dataclasses.replace(first.params, max_new_tokens=4),
    )
    engine.generate([warm])
    return timed_pass(engine, requests, device)


def timed_pass(engine: Engine, requests: list[Request], device: torch.device) -> tuple[dict, list]:
    """One timed ``generate`` of ``requests`` on ``engine`` as it is (graphs captured so far kept; the
    prefix index emptied, so no pass hits the blocks of an earlier one)."""
    if engine.cache_kind == "paged":
        engine.policy.pool.clear_index()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before, captures = engine.stats, _graph_captures(engine)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    _sync(device)
    seconds = time.perf_counter() - t0
    st = engine.stats
    tokens = sum(len(c.token_ids) for c in outs)
    steps = st.decode_steps - before.decode_steps
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "mean_decoding_together": (st.decode_rows - before.decode_rows) / max(steps, 1),
        "decode_steps": steps,
        "prefill_tokens": st.prefill_tokens - before.prefill_tokens,
        "prefix_hit_tokens": st.prefix_hit_tokens - before.prefix_hit_tokens,
        "preemptions": st.preemptions - before.preemptions,
        "kv_tokens": st.kv_tokens,
        "max_decoding_together": engine.num_slots,
        "graphs_captured": None if captures is None else _graph_captures(engine) - captures,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }, outs


_PHASES = ("_admit", "_prefill", "_sync", "_reserve_decode", "_decode")


def _generate_wrapped(engine: Engine, requests: list[Request], device: torch.device, wrap) -> float:
    """One ``generate`` of ``requests`` with each engine phase in ``_PHASES`` replaced by
    ``wrap(name, original)`` (restored after, also on error), the prefix index emptied first; returns its
    wall seconds (device-synchronized at both ends)."""
    for name in _PHASES:
        setattr(engine, name, wrap(name, getattr(engine, name)))
    if engine.cache_kind == "paged":
        engine.policy.pool.clear_index()
    try:
        _sync(device)
        t0 = time.perf_counter()
        engine.generate(requests)
        _sync(device)
        return time.perf_counter() - t0
    finally:
        for name in _PHASES:
            delattr(engine, name)


def profiled_pass(engine: Engine, requests: list[Request], device: torch.device) -> dict:
    """One more ``generate`` with the device synchronized around each engine phase (admission, prefill,
    host sync, block reservation, decode): seconds per phase, and decode seconds and steps per graph key
    (B rows, read length). The synchronizing changes the overlap of host and device, so its total is
    not the timed figure; it says where the time of a step goes."""
    phases = dict.fromkeys(_PHASES, 0.0)
    by_key: dict[str, list] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            key = None
            if name == "_decode":
                seqs = engine.scheduler.running
                key = f"{engine._bucket(len(seqs))}x{engine._read_len(seqs)}"
            _sync(device)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(device)
            dt = time.perf_counter() - t
            phases[name] += dt
            if key is not None:
                k = by_key.setdefault(key, [0, 0.0])
                k[0], k[1] = k[0] + 1, k[1] + dt
            return out

        return wrapper

    total = _generate_wrapped(engine, requests, device, timed)
    keys = sorted(by_key.items(), key=lambda kv: -kv[1][1])
    return {
        "seconds": total,
        "phases_s": {k.lstrip("_"): v for k, v in phases.items()},
        "other_s": total - sum(phases.values()),
        "decode_by_key": {k: {"steps": n, "seconds": t, "ms_per_step": 1e3 * t / n} for k, (n, t) in keys},
    }


def busy_pass(engine: Engine, requests: list[Request], device: torch.device) -> dict:
    """One more ``generate`` (CUDA) with a pair of timing events around each decode and prefill launch and no
    added synchronization: ``busy_s`` is the device time between each pair (the graphs' kernels and the
    gaps inside them), ``idle_s`` the rest of the wall time (the device waiting for the host: host syncs
    of sampled tokens, scheduling, launches). ``host_s`` per phase is host wall time (``_sync``, the
    in-place sync, includes its wait for the device)."""
    if device.type != "cuda":
        raise ValueError("--busy needs --device cuda (device events)")
    pairs: list[tuple] = []
    host = dict.fromkeys(_PHASES, 0.0)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            if name in ("_decode", "_prefill"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(*args, **kwargs)
                b.record()
                pairs.append((name, a, b))
            else:
                out = fn(*args, **kwargs)
            host[name] += time.perf_counter() - t
            return out

        return wrapper

    total = _generate_wrapped(engine, requests, device, timed)
    busy = {"_decode": 0.0, "_prefill": 0.0}
    for name, a, b in pairs:
        busy[name] += a.elapsed_time(b) / 1e3
    return {
        "seconds": total,
        "busy_s": sum(busy.values()),
        "decode_busy_s": busy["_decode"],
        "prefill_busy_s": busy["_prefill"],
        "idle_s": total - sum(busy.values()),
        "host_s": {k.lstrip("_"): v for k, v in host.items()},
    }


def kernel_profile(
    engine: Engine, requests: list[Request], device: torch.device, at: list[int], n: int
) -> dict:
    """One more ``generate`` in which, from each decode step in ``at`` (counted in this pass), ``n`` steps run
    as captured (CUDA graphs; device-synchronized at both ends: milliseconds per step) and the ``n`` after
    them eagerly under ``torch.profiler`` (device time per kernel name, summed, per step). The two windows
    are adjacent, so their rows and read lengths are nearly the same; graph step time minus the kernels'
    sum is the time the device spends between kernels (launch gaps inside the graph, host waits)."""
    from torch.profiler import ProfilerActivity, profile

    windows: dict[int, dict] = {}
    original = engine._decode
    state = {"step": 0}

    def wrapper():
        s = state["step"]
        state["step"] += 1
        for a in at:
            if s == a or s == a + n:
                _sync(device)
                windows.setdefault(a, {})["t_" + ("graph" if s == a else "eager")] = time.perf_counter()
                if s == a:
                    windows[a]["rows"] = len(engine.scheduler.running)
                    windows[a]["bucket"] = engine._bucket(len(engine.scheduler.running))
                else:
                    windows[a]["graph_ms_per_step"] = 1e3 * (time.perf_counter() - windows[a]["t_graph"]) / n
                    windows[a]["_graphs"], engine._graphs = engine._graphs, None
                    windows[a]["_prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    windows[a]["_prof"].__enter__()
            if s == a + 2 * n:
                _sync(device)
                w = windows[a]
                w["eager_wall_ms_per_step"] = 1e3 * (time.perf_counter() - w["t_eager"]) / n
                w["_prof"].__exit__(None, None, None)
                engine._graphs = w.pop("_graphs")
                kernels: dict[str, list] = {}
                for ev in w.pop("_prof").events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        k = kernels.setdefault(ev.name[:90], [0, 0.0])
                        k[0] += 1
                        k[1] += ev.device_time
                total = sum(v[1] for v in kernels.values())
                w["kernel_ms_per_step"] = total / 1e3 / n
                w["kernels_per_step"] = sum(v[0] for v in kernels.values()) / n
                w["top_kernels_us_per_step"] = {
                    k: round(v[1] / n, 1) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
                }
        return original()

    engine._decode = wrapper
    if engine.cache_kind == "paged":
        engine.policy.pool.clear_index()
    try:
        engine.generate(requests)
    finally:
        del engine._decode
        for w in windows.values():  # a window the run ended inside: its profiler closed, graphs back
            if "_prof" in w:
                w.pop("_prof").__exit__(None, None, None)
                engine._graphs = w.pop("_graphs")
    for w in windows.values():
        for key in ("t_graph", "t_eager"):
            w.pop(key, None)
    return {str(a): windows.get(a, {}) for a in at}


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return n


def _steps(text: str) -> list[int]:
    try:
        steps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated decode steps, e.g. 100,2000"
        ) from None
    if not steps:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one decode step, e.g. 100,2000")
    if any(x < 0 for x in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: decode steps must be >= 0")
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--prompts", type=_positive, default=8, help="groups (requests)")
    p.add_argument("--group", type=_positive, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=_positive, default=32)
    p.add_argument("--median-new", type=_positive, default=30, help="median response length (tokens)")
    p.add_argument("--max-new", type=_positive, default=300, help="longest response; 1%% of groups reach it")
    p.add_argument(
        "--kv-slots", type=_positive, default=8, help="KV memory, in slots of prompt-len + max-new tokens"
    )
    p.add_argument(
        "--max-slots", type=_positive, default=64, help="most sequences the paged engine decodes together"
    )
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument(
        "--buckets",
        choices=("pow2", "engine"),
        default="pow2",
        help="decode batch sizes B is rounded up to: powers of two (fewer CUDA-graph captures), or each "
        "engine's default as runs use it (cuda_graphs.graph_batch_buckets: at most 1.5x padding)",
    )
    p.add_argument("--sync-every", type=_positive, default=1)
    p.add_argument("--engines", default="slots,paged", help="comma-separated: slots, paged")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument(
        "--passes",
        type=_positive,
        default=1,
        help="timed passes per engine (the later ones with graphs captured)",
    )
    p.add_argument("--profile", action="store_true", help="then one pass timing each engine phase")
    p.add_argument(
        "--busy",
        action="store_true",
        help="then one pass (CUDA) with device events around each launch: device busy vs idle seconds",
    )
    p.add_argument(
        "--kernel-profile",
        type=_steps,
        default=[],
        help="comma-separated decode steps: from each, graph ms/step and a torch.profiler kernel table",
    )
    p.add_argument("--kernel-profile-steps", type=_positive, default=8, help="steps per window (>= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive, default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "paged_kv.json"))
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    if not engines or any(e not in ("slots", "paged") for e in engines) or len(set(engines)) < len(engines):
        p.error(f"--engines {args.engines!r}: a comma-separated list of distinct names from slots, paged")
    if args.median_new > args.max_new:
        p.error(f"--median-new {args.median_new} must be at most --max-new {args.max_new}")
    device = parse_device(p, args.device)
    if args.busy and device.type != "cuda":
        p.error("--busy needs --device cuda (device events)")
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = CONFIGS[args.config]
    torch.manual_seed(args.seed)
    model_cfg = dataclasses.replace(spec["model"], device=str(device), dtype=args.dtype)
    with torch.device(device):
        model = build_model(model_cfg, spec["vocab"]).eval()
    requests = workload(args, spec["vocab"])
    seq_len = args.prompt_len + args.max_new
    budget = args.kv_slots * seq_len
    common = dict(kv_token_budget=budget, sync_every=args.sync_every, seed=args.seed)
    makers = {
        "slots": lambda: Engine(
            model,
            max_slots=args.kv_slots,
            max_seq_len=seq_len,
            batch_buckets=pow2_buckets(args.kv_slots) if args.buckets == "pow2" else None,
            **common,
        ),
        "paged": lambda: Engine(
            model,
            cache="paged",
            max_slots=args.max_slots,
            block_size=args.block_size,
            batch_buckets=pow2_buckets(args.max_slots) if args.buckets == "pow2" else None,
            **common,
        ),
    }
    results, outs = {}, {}
    for name in engines:
        engine = makers[name]()
        results[name], outs[name] = run(engine, requests, device)
        for i in range(1, args.passes):
            results[name][f"pass{i + 1}"], _ = timed_pass(engine, requests, device)
        if args.profile:
            results[name]["profile"] = profiled_pass(engine, requests, device)
        if args.busy:
            results[name]["busy"] = busy_pass(engine, requests, device)
        if args.kernel_profile:
            results[name]["kernel_profile"] = kernel_profile(
                engine, requests, device, args.kernel_profile, args.kernel_profile_steps
            )
        print(
            f"{name}: {json.dumps(results[name])}", flush=True
        )  # kept in the log if a later engine is cut off
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "slots" in outs and "paged" in outs:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs["slots"], outs["paged"], strict=True))
        results["identical_completions"] = f"{same}/{len(outs['slots'])}"
        results["speedup"] = results["paged"]["tokens_per_s"] / results["slots"]["tokens_per_s"]
        for i in range(1, args.passes):
            a, b = results["paged"][f"pass{i + 1}"], results["slots"][f"pass{i + 1}"]
            results[f"speedup_pass{i + 1}"] = a["tokens_per_s"] / b["tokens_per_s"]

    lengths = [r.params.max_new_tokens for r in requests]
    print(
        f"paged_kv  config={args.config} groups={args.prompts}x{args.group} prompt={args.prompt_len} "
        f"new: median {sorted(lengths)[len(lengths) // 2]} max {max(lengths)} (cap {args.max_new}); "
        f"KV {budget} tokens; device={device} dtype={args.dtype}"
    )
    print(
        f"{'engine':<8}{'tokens':>9}{'seconds':>9}{'tokens/s':>10}{'together':>10}{'prefill':>9}{'hits':>9}{'preempt':>9}"
    )
    for name in ("slots", "paged"):
        if name in results:
            r = results[name]
            print(
                f"{name:<8}{r['tokens']:>9}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.1f}"
                f"{r['mean_decoding_together']:>10.1f}{r['prefill_tokens']:>9}{r['prefix_hit_tokens']:>9}"
                f"{r['preemptions']:>9}"
            )
    if "speedup" in results:
        print(
            f"paged / slots tokens/s: {results['speedup']:.2f}x; identical completions {results['identical_completions']}"
        )
    payload = {
        "benchmark": "paged_kv",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "kv_token_budget": budget},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(payload, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
