"""The EP dispatcher interface on one GPU: an MoE layer forward + backward and an engine decode step at
EP world size 1, each dispatcher of ``moerl.ep.DISPATCHERS`` against the same code without EP. A quick
check (under a minute) that the ``dispatch -> (rows, handle)`` / ``combine`` interface costs nothing on
the hot path; there is no before/after in one tree, so it prints milliseconds to compare with earlier runs
(``bench/moe_layer.py``: the block at about 60% of the matmul peak; ``bench/ep_engine_gpu.py``).

    python bench/ep_interface_gpu.py --device cuda     # one H200: reference widths, bf16, NCCL + gloo
    python bench/ep_interface_gpu.py                   # CPU smoke (tiny sizes, gloo)

1. MoE layer: one ``MoeBlock`` (router + E experts, top-k) of the spec's widths on T tokens, forward and
   backward (gradients of x, router and experts), timed with CUDA events; ``plain`` is the block as built
   (``moerl.models.moe.Experts``: fused experts on CUDA), the others swap its experts for
   ``ExpertParallelExperts`` over a one-rank group (dispatch -> grouped GEMM -> combine). TFLOP/s counts
   3 x 2 (H E + 3 k H I) per token; "of peak" divides by a bf16 matmul measured in this process.
2. Decode: B prompts of P tokens prefilled, then S decode steps timed (``Engine.step``, one token per
   sequence per step), the plain ``Engine`` eager, then ``EPEngine`` per dispatcher eager and with CUDA
   graphs (a group of one rank can be captured). ms per step = wall time / S.
Writes ``<out-dir>/ep_interface_gpu.json``. The script uses only names that predate the interface
(``moerl.ep.parallelize.DISPATCHERS``, ``ExpertParallelExperts``, ``EPEngine``), so a copy of it placed in
an older checkout times that checkout on the same machine, for a before/after in one device call.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
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
    measure_ceilings,
    random_prompts,
    time_fn,
    write_json,
)
from bench.rollout_gpu import engine_for, sampling_requests  # noqa: E402
from moerl.config import ModelConfig  # noqa: E402
from moerl.ep import Topology  # noqa: E402
from moerl.ep.parallelize import DISPATCHERS, ExpertParallelExperts  # noqa: E402
from moerl.models.build import arch_from_model_config  # noqa: E402
from moerl.models.model import MoeForCausalLM  # noqa: E402
from moerl.rollout.ep_engine import EPEngine  # noqa: E402


def build_model(spec_name: str, num_layers: int, device: torch.device, dtype: torch.dtype) -> MoeForCausalLM:
    """A fresh Qwen3-MoE model of ``SPECS[spec_name]``'s widths and ``num_layers`` layers, built on device."""
    s = SPECS[spec_name]
    cfg = ModelConfig(
        hidden_size=s.hidden_size, num_layers=num_layers, num_heads=s.num_heads, num_kv_heads=s.num_heads,
        head_dim=s.head_dim, num_experts=s.num_experts, top_k=s.top_k,
        moe_intermediate_size=s.moe_intermediate_size, max_position_embeddings=s.max_position_embeddings,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = MoeForCausalLM(arch_from_model_config(cfg, s.vocab_size))
        model.init_weights()
    return model.to(dtype).keep_router_buffers_fp32()


def time_layer(block, tokens: int, device: torch.device, dtype: torch.dtype, iters: int) -> float:
    """Median ms of one forward + backward of ``block`` (an ``MoeBlock``) on [1, T, H] tokens."""
    h = block.router.weight.shape[1]
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(1, tokens, h, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(1, tokens, h, generator=gen, device=device, dtype=dtype)
    params = list(block.parameters())

    def fwd_bwd() -> None:
        for p in params:
            p.grad = None
        block(x.detach().requires_grad_(True))[0].backward(dy)

    return time_fn(fwd_bwd, device, warmup=3, iters=iters).median_ms


def layer_rows(model, tokens: int, device, dtype, iters: int, peak_tflop_s: float) -> dict:
    """Part 1: the plain block and one EP copy per dispatcher; {name: {ms, tflop_s, of_peak}}."""
    spec_block = model.layers[0].mlp
    h, e = spec_block.router.weight.shape[1], spec_block.experts.gate_up_proj.shape[0]
    i, k = spec_block.experts.down_proj.shape[2], model.config.num_experts_per_tok
    flops = 3 * 2 * (h * e + 3 * k * h * i) * tokens
    rows = {"plain": time_layer(spec_block, tokens, device, dtype, iters)}
    for name in DISPATCHERS:
        block = copy.deepcopy(spec_block)
        block.experts = ExpertParallelExperts(block.experts, DISPATCHERS[name](Topology(1, 1), e))
        rows[f"ep1 {name}"] = time_layer(block, tokens, device, dtype, iters)
        del block
        free_device_memory(device)
    out = {}
    for name, ms in rows.items():
        tflop_s = flops / (ms * 1e-3) / 1e12
        out[name] = {"ms": ms, "tflop_s": tflop_s, "of_peak": tflop_s / peak_tflop_s}
        print(f"MoE layer fwd+bwd T={tokens} {name:18s}: {ms:8.3f} ms  {tflop_s:7.1f} TFLOP/s  "
              f"{out[name]['of_peak']:.1%} of the measured matmul peak")  # fmt: skip
    return out


def decode_ms(step, engine, prompts, steps: int, device: torch.device) -> float:
    """ms per decode step: the prompts prefilled by the first step (its time not counted), then ``steps``
    steps timed together (device synchronized around them)."""
    for r in sampling_requests(prompts, steps + 8, 1.0, f"d{time.monotonic_ns()}_"):
        engine.add_request(r)
    step()  # admit + prefill + first token
    step()  # first decode step (graph capture, if any, happens here)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = 1e3 * (time.perf_counter() - t0) / steps
    while engine.num_unfinished:  # drain, so the next measurement starts empty
        step()
    return ms


def decode_rows(model, batch: int, prompt_len: int, steps: int, device) -> dict:
    """Part 2: ms per decode step of the plain engine and of EPEngine per dispatcher."""
    prompts = random_prompts(model.config.vocab_size, batch, prompt_len)
    n = steps + 8
    out = {}
    e = engine_for(model, batch, prompt_len, n, 16, cuda_graphs=False)
    out["engine/eager"] = decode_ms(e.step, e, prompts, steps, device)
    del e
    for name in DISPATCHERS:
        graph_modes = (False, True) if device.type == "cuda" else (False,)
        for graphs in graph_modes:
            e = engine_for(copy.deepcopy(model), batch, prompt_len, n, 16, cuda_graphs=graphs,
                           batch_buckets=(batch,))  # fmt: skip
            ep = EPEngine(e, None, dispatcher=name)  # world size 1: the dispatcher path, nothing moves
            key = f"ep1 {name}/{'graphs' if graphs else 'eager'}"
            out[key] = decode_ms(ep.step, e, prompts, steps, device)
            del e, ep
            free_device_memory(device)
    for name, ms in out.items():
        print(f"decode step B={batch} P={prompt_len} {name:26s}: {ms:8.3f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", default=None, help="model widths (default: reference on CUDA, tiny on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="T of the layer (default 16384 CUDA, 256 CPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="decode batch B")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device(a.device)
    big = dev.type == "cuda"
    spec = a.spec or ("reference" if big else "tiny")
    tokens = a.tokens or (16384 if big else 256)
    dtype = bench_dtype(dev)
    init_one_rank_group(dev, 29561, "cpu:gloo,cuda:nccl" if big else "gloo", 120)
    try:
        peak = measure_ceilings(dev, copy_bytes=256 << 20).matmul_tflop_s
        model = build_model(spec, 2, dev, dtype)
        payload = {
            "benchmark": "ep_interface_gpu",
            "device": device_info(dev),
            "spec": dataclasses.asdict(SPECS[spec]) | {"num_layers": 2},
            "matmul_tflop_s": peak,
            "layer": layer_rows(model, tokens, dev, dtype, a.iters, peak),
            "decode_ms_per_step": decode_rows(model, a.batch, 128 if big else 16, a.steps, dev),
        }
    finally:
        dist.destroy_process_group()
    payload["wall_s"] = time.perf_counter() - t_start
    print(f"wall {payload['wall_s']:.1f} s; wrote {write_json('ep_interface_gpu', payload, a.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
