"""Rollout decode on the reference config: moerl's ``Engine`` against transformers' ``generate`` on the same
weights in the same process, against the memory-bandwidth floor, with the two agreement checks of the
one-GPU performance issue. (``bench/rollout.py``, the rollout engine's own benchmark, times the engine at
any config; this one adds the floor, the agreement checks and the engine settings for an H200.)

    python bench/rollout_gpu.py                                                     # CPU smoke (tiny)
    python bench/rollout_gpu.py --spec reference --batch 256 --prompt-len 128 \\
        --new-tokens 128 --device cuda                                              # the issue's figure

Every request samples exactly ``--new-tokens`` tokens at temperature 1 (no stop tokens, no top-k/top-p)
from a random prompt. tokens/s = generated tokens / wall time of the whole batch (prefill included), on
the median of ``--runs`` runs after one identical warm-up run (which also captures the CUDA graphs).

Floor: decode step i (i = 1 .. N-1) must read the weights it uses (every non-expert matrix, plus the
experts the batch touches) and the keys/values of B x (P + i) cached tokens, so
t_decode >= sum_i (W + B (P + i) kv) / BW, BW the copy bandwidth measured here; the prefill adds its
FLOPs over the measured matmul rate. "of floor" = floor time / measured time.

Agreement: (1) the model's logits with the fast paths (``moerl.models.kernels``) against the reference
path, and against transformers, on one batch (relative error, Frobenius); (2) the engine's per-token
log-probs against the trainer's recomputation (a full forward over prompt + completion, then
``moerl.rl.token_logprobs`` at the sampling temperature): mean and max absolute difference, in nats.
Writes ``<out-dir>/rollout_gpu.json``.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SPECS,
    ModelSpec,
    add_decode_args,
    bench_dtype,
    bench_parser,
    device_info,
    free_device_memory,
    measure_ceilings,
    peak_memory_gib,
    print_table,
    profile_top_kernels,
    random_prompts,
    rel_err,
    same_weights_pair,
    wall_time,
    write_json,
)
from moerl.models.kernels import fast_paths  # noqa: E402
from moerl.rl import token_logprobs  # noqa: E402
from moerl.rollout import Engine, Request, SamplingParams  # noqa: E402


def floor_seconds(
    spec: ModelSpec, batch: int, prompt_len: int, new_tokens: int, copy_tb_s: float, matmul_tflop_s: float
) -> dict:
    """Lower bounds of the run's time (see the module docstring); bf16 weights and KV cache."""
    w = spec.decode_weight_bytes(batch)
    kv = spec.kv_bytes_per_token()
    decode_bytes = sum(w + batch * (prompt_len + i) * kv for i in range(1, new_tokens))
    d = spec.num_heads * spec.head_dim
    prefill_flops = (
        2 * spec.active_matmul_params * batch * prompt_len + 2 * spec.num_layers * batch * prompt_len**2 * d
    )
    decode_s = decode_bytes / (copy_tb_s * 1e12)
    prefill_s = prefill_flops / (matmul_tflop_s * 1e12)
    return {
        "decode_bytes": decode_bytes,
        "weight_bytes_per_step": w,
        "decode_s": decode_s,
        "prefill_flops": prefill_flops,
        "prefill_s": prefill_s,
        "total_s": decode_s + prefill_s,
        "tokens_per_s": batch * new_tokens / (decode_s + prefill_s),
    }


def logits_agreement(hf, ours, vocab: int, device: torch.device) -> dict:
    """Relative errors of the logits on one batch: the fast paths against the reference path (both in the
    model dtype), and each of moerl-fast, moerl-reference and transformers against a float32 copy of the
    moerl model (the higher-precision reference of METHOD.md).

    Top-k routing is discontinuous: where a token's k-th and (k+1)-th router scores are closer than the
    bf16 rounding, two correct implementations choose different experts and the logits move by far more
    than rounding. ``fast_vs_reference_same_routing`` therefore also runs the fast path with the
    reference path's expert choices replayed (``forced_experts``, as R3 routing replay does), which
    isolates the kernels' numerics; ``routing_flip_frac`` is the share of (token, layer, slot) expert
    choices on which the free-running fast and reference paths differ.
    """
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        fast_out = ours(ids, return_routed_experts=True)
        with fast_paths(False):
            ref_out = ours(ids, return_routed_experts=True)
        replayed = ours(ids, forced_experts=ref_out.routed_experts).logits
        fast, ref = fast_out.logits, ref_out.logits
        theirs = hf(input_ids=ids).logits
        ref32 = copy.deepcopy(ours).float()
        exact = ref32(ids, forced_experts=ref_out.routed_experts).logits
        exact_free = ref32(ids).logits
        del ref32
    a, b = fast_out.routed_experts.sort(-1).values, ref_out.routed_experts.sort(-1).values
    return {
        "fast_vs_reference": rel_err(fast, ref),
        "fast_vs_reference_same_routing": rel_err(replayed, ref),
        "routing_flip_frac": float((a != b).float().mean()),
        "reference_vs_transformers": rel_err(ref, theirs),
        "fast_vs_transformers": rel_err(fast, theirs),
        "fast_vs_float32": rel_err(fast, exact_free),
        "reference_vs_float32": rel_err(ref, exact_free),
        "transformers_vs_float32": rel_err(theirs, exact_free),
        "reference_vs_float32_same_routing": rel_err(ref, exact),
    }


def logprob_agreement(model, completions, temperature: float, device: torch.device, rows: int = 32) -> dict:
    """Engine log-probs against the trainer's recomputation over prompt + completion (nats)."""
    diffs = []
    for c in completions[:rows]:
        ids = torch.tensor([c.prompt_ids + c.token_ids], device=device)
        labels = ids.clone()
        labels[:, : len(c.prompt_ids)] = -100
        with torch.no_grad():
            logp = token_logprobs(model(ids).logits, labels, temperature)[0, len(c.prompt_ids) :]
        diffs.append((logp.float().cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return {
        "rows": len(diffs),
        "tokens": d.numel(),
        "mean_abs_diff": float(d.mean()),
        "max_abs_diff": float(d.max()),
    }


def graphs_vs_eager(
    model, prompts: list[list[int]], device: torch.device, rows: int = 8, new_tokens: int = 16
):
    """Greedy generation with and without CUDA graphs (same kernels either way: expect identical tokens
    and log-probs). None where the engine has no ``cuda_graphs`` switch or off CUDA."""
    if device.type != "cuda" or "cuda_graphs" not in inspect.signature(Engine.__init__).parameters:
        return None
    p = len(prompts[0])
    outs = {}
    for flag in (True, False):
        engine = Engine(
            model,
            max_slots=rows,
            kv_token_budget=rows * (p + new_tokens),
            max_seq_len=p + new_tokens,
            cuda_graphs=flag,
        )
        outs[flag] = engine.generate(
            [
                Request(
                    request_id=f"g{i}",
                    prompt_ids=q,
                    params=SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                )
                for i, q in enumerate(prompts[:rows])
            ]
        )
    pairs = list(zip(outs[True], outs[False], strict=True))
    diffs = [
        abs(x - y)
        for a, b in pairs
        if a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    ]
    return {
        "rows": len(pairs),
        "identical_token_rows": sum(a.token_ids == b.token_ids for a, b in pairs),
        "max_abs_logprob_diff": max(diffs) if diffs else None,
    }


def profile_decode(model, prompts: list[list[int]], device: torch.device, steps: int = 8) -> list[dict]:
    """Kernel breakdown of ``steps`` pure decode steps of the engine (eager when it has a graph switch,
    so the kernels are visible), after a first ``step()`` that admits and prefills the whole batch."""
    kw = {"cuda_graphs": False} if "cuda_graphs" in inspect.signature(Engine.__init__).parameters else {}
    engine = engine_for(model, len(prompts), len(prompts[0]), steps + 2, steps + 4, **kw)
    for r in sampling_requests(prompts, steps + 2, 1.0, "prof"):
        engine.add_request(r)
    engine.step()
    engine.step()

    def decode_steps() -> None:
        for _ in range(steps):
            engine.step()

    return profile_top_kernels(decode_steps, device)


def sampling_requests(
    prompts: Sequence[list[int]], new_tokens: int, temperature: float, tag: str, *, record: bool = False
) -> list[Request]:
    """One request per prompt (ids ``<tag><i>``, seed i): exactly ``new_tokens`` tokens at ``temperature``
    (no stop tokens, no top-k/top-p); ``record`` asks for the routed experts (R3)."""
    return [
        Request(
            request_id=f"{tag}{i}",
            prompt_ids=p,
            params=SamplingParams(
                temperature=temperature, max_new_tokens=new_tokens, seed=i, return_routed_experts=record
            ),
        )
        for i, p in enumerate(prompts)
    ]


KV_CACHE = {"kind": "slots"}
"""``--kv-cache``: the engine ``engine_for`` builds (``Engine`` over the ``slots`` or ``paged`` cache policy)."""


def engine_for(model, batch: int, prompt_len: int, new_tokens: int, sync_every: int, **kw) -> Engine:
    """An ``Engine`` (the paged cache policy with ``--kv-cache paged``) sized for B = ``batch`` prompts of P =
    ``prompt_len`` tokens and N = ``new_tokens``: B slots, a KV budget of B (P + N) tokens, all B prompts
    prefilled in one step; ``kw`` goes to the engine."""
    if KV_CACHE["kind"] == "paged":  # sized by blocks: no max_seq_len (the longest sequence is the cache)
        return Engine(
            model,
            cache="paged",
            max_slots=batch,
            kv_token_budget=batch * (prompt_len + new_tokens),
            max_prefill_tokens=batch * prompt_len,
            sync_every=sync_every,
            **kw,
        )
    return Engine(
        model,
        max_slots=batch,
        kv_token_budget=batch * (prompt_len + new_tokens),
        max_seq_len=prompt_len + new_tokens,
        max_prefill_tokens=batch * prompt_len,
        sync_every=sync_every,
        **kw,
    )


@dataclass(frozen=True, slots=True)
class GenerateTimes:
    """Wall times of ``time_generate``, in seconds, and the completions of its last timed run."""

    warmup_s: float
    seconds: list[float]
    prefill_s: float
    completions: list

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def time_generate(
    engine: Engine, prompts, new_tokens: int, temperature: float, runs: int, device, *, record: bool = False
) -> GenerateTimes:
    """A warm-up ``engine.generate`` of the requests (it captures the CUDA graphs), ``runs`` timed ones and
    a prefill-only one (one new token each), each timed by ``wall_time`` (device synced around it)."""
    outs: list = []

    def gen(tag: str, n: int = new_tokens) -> None:
        outs[:] = engine.generate(sampling_requests(prompts, n, temperature, tag, record=record))

    warm_s = wall_time(lambda: gen("w"), device)
    times = [wall_time(lambda tag=f"r{r}_": gen(tag), device) for r in range(runs)]
    completions = list(outs)
    prefill_s = wall_time(lambda: gen("p", 1), device)
    return GenerateTimes(warm_s, times, prefill_s, completions)


def bench_engine(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    runs: int,
    sync_every: int,
    device: torch.device,
) -> tuple[dict, list]:
    """Warm-up run, ``runs`` timed runs and a prefill-only run of ``Engine.generate``."""
    engine = engine_for(model, len(prompts), len(prompts[0]), new_tokens, sync_every)
    t = time_generate(engine, prompts, new_tokens, temperature, runs, device)
    completions = t.completions
    tokens = sum(len(c.token_ids) for c in completions)
    med = t.median_s
    graphs = getattr(engine, "_graphs", None)
    result = {
        "seconds": t.seconds,
        "median_s": med,
        "warmup_s": t.warmup_s,
        "tokens": tokens,
        "tokens_per_s": tokens / med,
        "prefill_only_s": t.prefill_s,
        "decode_s": med - t.prefill_s,
        "num_slots": engine.num_slots,
        "sync_every": sync_every,
        "peak_memory_gib": peak_memory_gib(device),
        "cuda_graphs": None
        if graphs is None
        else {"enabled": graphs.is_enabled, "graphs": graphs.num_graphs, "replays": graphs.num_replays},
    }
    return result, completions


def bench_transformers(hf, prompts: list[list[int]], new_tokens: int, temperature: float, device) -> dict:
    """One timed ``generate`` (sampling, no top-k/top-p, no EOS) after a two-token warm-up."""
    ids = torch.tensor(prompts, device=device)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=temperature > 0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        eos_token_id=None,
    )
    if temperature > 0:
        kw["temperature"] = temperature
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, **kw)
        out = []
        seconds = wall_time(lambda: out.append(hf.generate(ids, max_new_tokens=new_tokens, **kw)), device)
    tokens = (out[0].shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "new_tokens": new_tokens,
        "peak_memory_gib": peak_memory_gib(device),
    }


def run(
    spec_name: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: torch.device,
    *,
    runs: int = 3,
    sync_every: int = 16,
    temperature: float = 1.0,
    baseline: bool = True,
    hf_new_tokens: int | None = None,
    out_dir: str | None = None,
    profile_steps: int = 0,
) -> dict:
    """The whole benchmark; returns the payload written to rollout_gpu.json."""
    dtype = bench_dtype(device)
    spec = SPECS[spec_name]
    ceilings = measure_ceilings(device)
    hf, ours = same_weights_pair(spec, device, dtype)
    agreement = {"logits": logits_agreement(hf, ours, spec.vocab_size, device)}
    prompts = random_prompts(spec.vocab_size, batch, prompt_len)
    free_device_memory(device)
    results = {}
    results["moerl"], completions = bench_engine(
        ours, prompts, new_tokens, temperature, runs, sync_every, device
    )
    agreement["engine_vs_trainer_logprobs"] = logprob_agreement(ours, completions, temperature, device)
    agreement["graphs_vs_eager_greedy"] = graphs_vs_eager(ours, prompts, device)
    profile = profile_decode(ours, prompts, device, profile_steps) if profile_steps else []
    if baseline:
        free_device_memory(device)
        results["transformers"] = bench_transformers(
            hf, prompts, hf_new_tokens or new_tokens, temperature, device
        )
        results["speedup"] = results["moerl"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
    floor = floor_seconds(spec, batch, prompt_len, new_tokens, ceilings.copy_tb_s, ceilings.matmul_tflop_s)
    m = results["moerl"]
    floor["of_floor_total"] = floor["total_s"] / m["median_s"]
    floor["of_floor_decode"] = floor["decode_s"] / m["decode_s"] if m["decode_s"] > 0 else None
    payload = {
        "benchmark": "rollout_gpu",
        **device_info(device),
        "spec": spec.as_dict(),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "temperature": temperature,
        "dtype": str(dtype),
        "transformers_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "ceilings": ceilings.as_dict(),
        "floor": floor,
        "agreement": agreement,
        "results": results,
        "decode_profile_eager": profile,
    }
    write_json("rollout_gpu", payload, out_dir)
    _print(payload)
    return payload


def _print(p: dict) -> None:
    r, f = p["results"], p["floor"]
    rows = [["moerl", r["moerl"]["tokens"], r["moerl"]["median_s"], r["moerl"]["tokens_per_s"], 1.0]]
    if "transformers" in r:
        t = r["transformers"]
        rows.append(["transformers", t["tokens"], t["seconds"], t["tokens_per_s"], 1 / r["speedup"]])
    rows.append(
        [
            "floor",
            r["moerl"]["tokens"],
            f["total_s"],
            f["tokens_per_s"],
            f["tokens_per_s"] / r["moerl"]["tokens_per_s"],
        ]
    )
    print_table(
        f"rollout B={p['batch']} P={p['prompt_len']} N={p['new_tokens']} T={p['temperature']} "
        f"{p['spec']['name']} {p['device']} (copy {p['ceilings']['copy_tb_s']:.2f} TB/s)",
        ["engine", "tokens", "seconds", "tokens/s", "x moerl"],
        rows,
    )
    a = p["agreement"]
    lp = a["engine_vs_trainer_logprobs"]
    print(
        f"moerl decode {r['moerl']['decode_s']:.3f} s (of floor {f['of_floor_decode'] or 0:.3f}), prefill "
        f"{r['moerl']['prefill_only_s']:.3f} s; of floor (total) {f['of_floor_total']:.3f}; "
        f"speedup {r.get('speedup', float('nan')):.1f}x; graphs {r['moerl']['cuda_graphs']}"
    )
    lg = a["logits"]
    print(
        f"logits rel err: fast vs ref {lg['fast_vs_reference']:.2e} (same routing "
        f"{lg['fast_vs_reference_same_routing']:.2e}, flips {lg['routing_flip_frac']:.4f}); vs float32: fast {lg['fast_vs_float32']:.2e} "
        f"ref {lg['reference_vs_float32']:.2e} transformers {lg['transformers_vs_float32']:.2e}; "
        f"engine vs trainer log-probs: mean |d| "
        f"{lp['mean_abs_diff']:.4f} max {lp['max_abs_diff']:.4f} nats over {lp['tokens']} tokens"
    )


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    add_decode_args(ap)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--kv-cache", choices=["slots", "paged"], default="slots", help="engine cache layout")
    ap.add_argument(
        "--hf-new-tokens",
        type=int,
        default=None,
        help="new tokens of the transformers run (default --new-tokens; fewer saves device time)",
    )
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many eager decode steps (CUDA)"
    )
    args = vars(ap.parse_args(argv))
    KV_CACHE["kind"] = args.pop("kv_cache")
    run(**args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
