"""Shared helpers of the one-GPU benchmarks (bench/moe_layer.py, bench/train_step.py, bench/rollout_gpu.py).

What lives here: the model shapes (``SPECS``: the issue's reference OLMoE-sized Qwen3-MoE and a tiny one for
CPU smoke runs, the sizes taken from the planner's presets ``moerl.plan.models.MODELS``), FLOP and byte counts
of those shapes, the measured hardware ceilings (device-to-device copy bandwidth and bf16 matrix-product rate,
taken in the same process as the figures they normalize), timing with CUDA events (median of repeats), atomic
JSON output, the command-line arguments they share, and the same-weights model pair: a seeded Hugging Face transformers model and the moerl model
holding identical tensors (copied in memory through moerl's checkpoint key map, so nothing is written to
disk).

Shape legend: V vocabulary, H hidden size, L layers, nh heads, hd head dim, E experts, k top-k,
I expert intermediate size, B batch, T sequence length.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.plan.models import MODELS, ModelShape

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a Qwen3-MoE decoder (no GQA, every layer MoE, untied embeddings)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    max_position_embeddings: int = 4096

    @classmethod
    def from_shape(cls, shape: ModelShape, max_position_embeddings: int = 4096) -> ModelSpec:
        """The spec of the planner's preset ``shape`` (``moerl.plan.models.MODELS``: one table of sizes).

        Raises:
            ValueError: ``shape`` is not one this spec holds (MLA, GQA with fewer KV heads, dense layers,
                shared experts or tied embeddings).
        """
        mha = shape.attention == "gqa" and shape.num_kv_heads in (0, shape.num_heads)
        if not mha or shape.num_dense_layers or shape.num_shared_experts or shape.tie_embeddings:
            raise ValueError(
                f"model {shape.name!r} is not an MHA, all-MoE, untied shape: attention={shape.attention!r}, "
                f"num_kv_heads={shape.num_kv_heads}, num_heads={shape.num_heads}, num_dense_layers="
                f"{shape.num_dense_layers}, num_shared_experts={shape.num_shared_experts}, "
                f"tie_embeddings={shape.tie_embeddings}"
            )
        own = (f.name for f in dataclasses.fields(cls) if f.name != "max_position_embeddings")
        return cls(**{f: getattr(shape, f) for f in own}, max_position_embeddings=max_position_embeddings)

    @property
    def attn_params_per_layer(self) -> int:
        """q, k, v, o projections: 4 * H * nh * hd."""
        return 4 * self.hidden_size * self.num_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU weights: 3 * H * I."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_params(self) -> int:
        """All parameters (embedding, layers, final norm, lm_head)."""
        h, layer_norms = self.hidden_size, 2 * self.hidden_size + 2 * self.head_dim
        per_layer = self.attn_params_per_layer + h * self.num_experts + self.num_experts * self.expert_params
        return 2 * self.vocab_size * h + self.num_layers * (per_layer + layer_norms) + h

    @property
    def active_matmul_params(self) -> int:
        """Parameters that multiply each token (Kaplan et al. 2020's N without the embedding): attention,
        router, k experts per layer, and the lm_head."""
        per_layer = (
            self.attn_params_per_layer + self.hidden_size * self.num_experts + self.top_k * self.expert_params
        )
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size

    def moe_flops_per_token(self) -> int:
        """Forward FLOPs of one MoE block per token: 2 * (H * E router + k * 3 * H * I experts)."""
        return 2 * (self.hidden_size * self.num_experts + self.top_k * self.expert_params)

    def train_flops_per_token(self, seq_len: int) -> int:
        """Training (forward + backward) FLOPs per token: 6 N + 12 L T (nh hd), N = active matmul
        parameters, the second term the attention scores and values without a causal discount
        (Chowdhery et al. 2022, PaLM, Appendix B)."""
        attn = 12 * self.num_layers * seq_len * self.num_heads * self.head_dim
        return 6 * self.active_matmul_params + attn

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """Key + value bytes of one cached token over all layers."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * elem_bytes

    def decode_weight_bytes(self, batch: int, elem_bytes: int = 2) -> float:
        """Weight bytes one decode step of ``batch`` rows must read: every non-expert matrix (attention,
        router, norms, lm_head; the embedding reads only B rows) plus the experts touched, expected
        E * (1 - (1 - k/E)^B) per layer under uniform routing."""
        h, e = self.hidden_size, self.num_experts
        touched = e * (1.0 - (1.0 - self.top_k / e) ** batch)
        per_layer = self.attn_params_per_layer + h * e + touched * self.expert_params
        return elem_bytes * (self.num_layers * per_layer + self.vocab_size * h + batch * h)

    def as_dict(self) -> dict:
        """Fields plus the derived parameter counts."""
        return {
            **dataclasses.asdict(self),
            "num_params": self.num_params,
            "active_matmul_params": self.active_matmul_params,
        }


SPECS: dict[str, ModelSpec] = {
    # The reference model: OLMoE-sized Qwen3-MoE, ~6.9 B parameters, ~1.2 B active matmul parameters.
    "reference": ModelSpec.from_shape(MODELS["reference"]),
    # Same widths, 4 layers: the quick first device call.
    "reference4": ModelSpec.from_shape(MODELS["reference4"]),
    "tiny": ModelSpec.from_shape(MODELS["tiny"], max_position_embeddings=512),
}


# ----------------------------------------------------------------------------------------------
# Device facts, ceilings and timing


def device_info(device: torch.device) -> dict:
    """Device name, torch/CUDA/transformers versions and the date, for the result files."""
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            device=p.name,
            cuda=torch.version.cuda,
            sm_count=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
        )
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


@dataclass(frozen=True, slots=True)
class TimeStats:
    """Repeated timings of one callable, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    iters: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, iters: int = 10) -> TimeStats:
    """Time ``fn`` ``iters`` times after ``warmup`` calls; CUDA events around each call on CUDA (the
    median is robust to a stray slow launch), ``perf_counter`` with no sync needed on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return TimeStats(statistics.median(times), min(times), max(times), iters)


def wall_time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device synchronized before and after (host-driven loops)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Hardware ceilings measured in this process (METHOD.md: measure them, datasheets are leads)."""

    copy_tb_s: float
    """Device-to-device copy bandwidth, bytes read + bytes written per second, in TB/s."""
    matmul_tflop_s: float
    """bf16 matrix product rate on random data (M = N = K), in TFLOP/s."""
    copy_bytes: int
    matmul_size: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_ceilings(device: torch.device, *, copy_bytes: int = 4 << 30, matmul_size: int = 8192) -> Ceilings:
    """Copy bandwidth (a ``copy_bytes`` bf16 buffer, counted twice: read + write) and the bf16 matmul
    rate (2 n^3 FLOPs per n x n x n product, two input sets alternated so the L2 cache cannot hold them).
    On CPU the sizes shrink to 16 MiB and 128 (the smoke run only checks the code path)."""
    if device.type != "cuda":
        copy_bytes, matmul_size = min(copy_bytes, 16 << 20), min(matmul_size, 128)
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(copy_bytes // 2, generator=gen, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = time_fn(lambda: dst.copy_(src), device, warmup=2, iters=10)
    n = matmul_size
    mats = [torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(4)]
    state = {"i": 0}

    def mm() -> torch.Tensor:
        state["i"] ^= 1
        a, b = mats[2 * state["i"]], mats[2 * state["i"] + 1]
        return a @ b

    t_mm = time_fn(mm, device, warmup=3, iters=10)
    return Ceilings(
        copy_tb_s=2 * copy_bytes / (t_copy.median_ms * 1e-3) / 1e12,
        matmul_tflop_s=2 * n**3 / (t_mm.median_ms * 1e-3) / 1e12,
        copy_bytes=copy_bytes,
        matmul_size=n,
    )


def init_one_rank_group(device: torch.device, port: int, backend: str, timeout_s: float) -> None:
    """Join a process group of this process alone (rank 0 of 1; the EP benchmarks at world size 1):
    rendezvous at 127.0.0.1:``port`` unless MASTER_ADDR / MASTER_PORT are set, the CUDA device made
    current first (NCCL binds to it). ``backend``: as ``torch.distributed.init_process_group`` takes it
    ("nccl", "gloo", "cpu:gloo,cuda:nccl"); ``timeout_s`` bounds every collective, in seconds."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak allocated device memory since the last reset, GiB (None on CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    """Return cached blocks and reset the peak counter (between benchmarks in one process)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------------------------
# Numerics and output


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius, float64), the agreement measure of METHOD.md; inf for NaN."""
    out, ref = out.detach().double(), ref.detach().to(out.device).double()
    err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    return err if err == err else float("inf")


def write_json(name: str, payload: dict, out_dir: str | Path | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` atomically (temp file + rename); default ``bench/results``."""
    folder = Path(out_dir) if out_dir else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)
    return path


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    """A fixed-width table: floats with 3 significant decimals, other cells as text."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return "-" if v is None else str(v)

    table = [header] + [[cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"== {title}")
    for r in table:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of every one-GPU benchmark: ``--spec`` (a ``SPECS`` name, into ``spec_name``),
    ``--device`` (parsed to a ``torch.device``) and ``--out-dir``; each argument's name is a keyword of the
    benchmark's ``run``, so ``run(**vars(parser.parse_args(argv)))`` calls it."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", dest="spec_name", choices=sorted(SPECS), default="tiny")
    ap.add_argument("--device", type=torch.device, default="cpu")
    ap.add_argument("--out-dir", default=None, help="where the JSON result goes (default bench/results)")
    return ap


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """The request shape and timing arguments of the decode benchmarks (B prompts of P random tokens,
    N new tokens each; median of ``--runs`` runs)."""
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=16, help="decode steps between host syncs")


# ----------------------------------------------------------------------------------------------
# The same-weights model pair


def bench_dtype(device: torch.device) -> torch.dtype:
    """The benchmarks' model dtype: bfloat16 on CUDA, float32 elsewhere (the CPU smoke runs)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def same_weights_pair(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> tuple:
    """(transformers model, moerl model) of ``spec`` holding the same seed-0 weights: ``build_hf``, then
    ``moerl_from_hf``."""
    hf = build_hf(spec, device, dtype, seed=0)
    return hf, moerl_from_hf(hf, device, dtype)


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 3) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` token ids uniform in [0, vocab_size) (seeded CPU generator)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).tolist()


def hf_config(spec: ModelSpec):
    """transformers' ``Qwen3MoeConfig`` of ``spec`` (SDPA attention, every layer MoE, untied)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.moe_intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


@torch.no_grad()
def init_seeded_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) matrices and unit norm weights, drawn in parameter order from one seeded generator
    on the parameters' device (the same seed gives the same model on the same device)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


def build_hf(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A seeded transformers ``Qwen3MoeForCausalLM`` of ``spec``, built directly on ``device`` in ``dtype``."""
    import transformers

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config(spec))
    finally:
        torch.set_default_dtype(prev)
    init_seeded_(model, seed)
    return model.eval()


@torch.no_grad()
def moerl_from_hf(hf_model, device: torch.device, dtype: torch.dtype):
    """The moerl ``MoeForCausalLM`` holding copies of ``hf_model``'s tensors (checkpoint key map of
    ``moerl.models.keymaps``; fused or per-expert expert layouts).

    Raises:
        KeyError: a transformers tensor with no moerl name, or a moerl tensor left unfilled.
    """
    from moerl.models import MoeConfig, MoeForCausalLM
    from moerl.models.keymaps import ExpertSlice, KeyMapper

    cfg = MoeConfig.from_hf_dict(hf_model.config.to_dict())
    with torch.device("meta"):
        model = MoeForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    mapper = KeyMapper(cfg.model_type, cfg.num_hidden_layers)
    ours = model.state_dict()
    filled: set[str] = set()
    for key, t in hf_model.state_dict().items():
        if mapper.is_ignored(key):
            continue
        name = mapper.to_ours(key)
        if name is None:
            raise KeyError(f"transformers tensor {key!r} has no moerl name")
        if isinstance(name, ExpertSlice):
            dst = ours[name.name][name.expert]
            half = dst.shape[0] // 2
            {"gate": dst[:half], "up": dst[half:], "down": dst}[name.part].copy_(t)
            filled.add(name.name)
        else:
            ours[name].copy_(t)
            filled.add(name)
    missing = [n for n in ours if n not in filled]
    if missing:
        raise KeyError(f"moerl tensors not filled from the transformers model: {missing[:10]}")
    model.rotary = model.build_rotary().to(device)
    return model.keep_router_buffers_fp32().eval()


def profile_top_kernels(fn: Callable[[], object], device: torch.device, *, top: int = 12) -> list[dict]:
    """Device time per kernel name over one call of ``fn`` (torch.profiler), largest first; prints them.
    Empty off CUDA."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = prof.key_averages()

    def dev_us(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))

    total = sum(dev_us(e) for e in events)
    rows = sorted(events, key=dev_us, reverse=True)[:top]
    out = [{"name": e.key[:120], "device_ms": dev_us(e) / 1e3, "count": e.count} for e in rows]
    print(f"-- top kernels (device total {total / 1e3:.2f} ms)")
    for r in out:
        print(f"   {r['device_ms']:9.3f} ms  x{r['count']:<6} {r['name'][:90]}")
    return out
