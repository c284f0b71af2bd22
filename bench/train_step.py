"""Training-step throughput and model FLOPs utilization (MFU): moerl's ``Trainer.train_step`` against a
Hugging Face transformers training step on the same weights, in the same process.

    python bench/train_step.py                                                        # CPU smoke (tiny)
    python bench/train_step.py --spec reference --batches 8,16 --seq-len 1024 --device cuda   # H200
    python bench/train_step.py --spec reference --batches 8,16,24,32 --seq-len 1024 --device cuda \
        --activation-checkpointing --no-baseline      # the trainer.num_ranks=1 memory settings

A step is forward + backward + gradient clipping + AdamW over ``batch x seq_len`` tokens, every parameter
trained (bf16 weights, gradients and AdamW moments on CUDA). moerl runs its RL step (GRPO loss on the
response part of each sequence, per-token log-probs as the rollout computes them, router statistics);
transformers runs the causal-LM cross-entropy step a user would write. MFU = tokens/s x FLOPs per
token / the bf16 matmul rate measured in this process, FLOPs per token = 6 N + 12 L T (nh hd), N the
active matmul parameters (PaLM, Chowdhery et al. 2022, App. B). transformers runs first and is freed
before moerl's optimizer is built, so each side has the whole GPU. Writes ``<out-dir>/train_step.json``.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SPECS,
    bench_dtype,
    bench_parser,
    device_info,
    free_device_memory,
    measure_ceilings,
    peak_memory_gib,
    print_table,
    profile_top_kernels,
    same_weights_pair,
    wall_time,
)
from bench.common import write_json as _write_json  # noqa: E402
from moerl.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from moerl.trainer.batch import TrainBatch  # noqa: E402
from moerl.trainer.local import LocalTrainer  # noqa: E402


def make_batch(batch: int, seq_len: int, vocab: int, prompt_len: int, group_size: int = 4) -> TrainBatch:
    """A full (unpadded) GRPO batch of random tokens: prompt, then a trained response; behaviour
    log-probs -log V (the random model's typical value, so importance ratios are near 1)."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    groups = math.ceil(batch / group_size)
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        behaviour_logprobs=torch.where(loss_mask, -math.log(vocab), 0.0).float(),
        advantages=torch.randn(batch, generator=gen),
        rewards=torch.rand(batch, generator=gen),
        group_ids=torch.arange(batch) // group_size,
        policy_versions=torch.zeros(batch, dtype=torch.int64),
        num_tokens=int(loss_mask.sum()),
        num_seqs=batch,
        task_ids=tuple(f"t{g}" for g in range(groups)),
        lease_tokens=tuple(range(groups)),
        group_versions=(0,) * groups,
    )


def _summary(times: list[float], tokens: int, flops_per_token: int, peak_tflop_s: float, device) -> dict:
    med = statistics.median(times)
    tok_s = tokens / med
    return {
        "step_s": times,
        "median_step_s": med,
        "tokens_per_s": tok_s,
        "tflop_s": tok_s * flops_per_token / 1e12,
        "mfu": tok_s * flops_per_token / (peak_tflop_s * 1e12),
        "peak_memory_gib": peak_memory_gib(device),
    }


def bench_transformers(hf, batch: TrainBatch, steps: int, device) -> list[float]:
    """Timed steps of a plain transformers step: loss = causal-LM cross-entropy, backward, clip, AdamW."""
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
    ids = batch.input_ids.to(device)

    def step() -> None:
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    wall_time(step, device)  # warm-up: allocates the AdamW moments
    times = [wall_time(step, device) for _ in range(steps)]
    return times


def bench_moerl(
    model,
    batch: TrainBatch,
    steps: int,
    device,
    profile: list | None = None,
    *,
    activation_checkpointing: bool = False,
    micro_batch_size: int | None = None,
) -> tuple[list[float], list[float]]:
    """Timed ``Trainer.train_step`` calls (the trainer of ``trainer.num_ranks=1``); also returns grad norms.

    One micro-batch = the whole batch unless ``micro_batch_size``; ``activation_checkpointing`` is
    ``trainer.activation_checkpointing`` (each decoder layer recomputed in the backward pass). Log-probs
    and entropies are always computed in float32 chunks (``moerl.rl.token_logprobs``). The trainer's own
    optimizer is used: ``torch.optim.AdamW(fused=True)`` on CUDA.
    """
    cfg = TrainerConfig(
        micro_batch_size=micro_batch_size or batch.num_sequences,
        lr=1e-5,
        grad_clip=1.0,
        activation_checkpointing=activation_checkpointing,
    )
    trainer = LocalTrainer(model, cfg, AlgorithmConfig(preset="grpo"), temperature=1.0)
    norms: list[float] = []
    wall_time(lambda: norms.append(trainer.train_step(batch).grad_norm), device)
    if profile is not None:
        profile.extend(profile_top_kernels(lambda: trainer.train_step(batch), device))
    times = [
        wall_time(lambda: norms.append(trainer.train_step(batch).grad_norm), device) for _ in range(steps)
    ]
    trainer.optimizer.zero_grad(set_to_none=True)
    return times, norms


def run(
    spec_name: str,
    batches: list[int],
    seq_len: int,
    device: torch.device,
    *,
    steps: int = 3,
    baseline: bool = True,
    out_dir: str | None = None,
    profile: bool = False,
    activation_checkpointing: bool = False,
    micro_batch_size: int | None = None,
) -> dict:
    """transformers (at the first batch size) then moerl at every batch size; returns the payload."""
    dtype = bench_dtype(device)
    spec = SPECS[spec_name]
    ceilings = measure_ceilings(device)
    flops_tok = spec.train_flops_per_token(seq_len)
    hf, ours = same_weights_pair(spec, device, dtype)
    results: dict[str, dict] = {}
    if baseline:
        free_device_memory(device)
        b = batches[0]
        try:
            times = bench_transformers(
                hf, make_batch(b, seq_len, spec.vocab_size, seq_len // 8), steps, device
            )
            results[f"transformers/b{b}"] = _summary(
                times, b * seq_len, flops_tok, ceilings.matmul_tflop_s, device
            )
        except torch.OutOfMemoryError as e:
            results[f"transformers/b{b}"] = {"error": f"out of memory: {e}"[:300]}
    del hf
    for b in batches:
        free_device_memory(device)
        try:
            prof = [] if profile and b == batches[0] else None
            times, norms = bench_moerl(
                ours,
                make_batch(b, seq_len, spec.vocab_size, seq_len // 8),
                steps,
                device,
                prof,
                activation_checkpointing=activation_checkpointing,
                micro_batch_size=micro_batch_size,
            )
            results[f"moerl/b{b}"] = {
                **_summary(times, b * seq_len, flops_tok, ceilings.matmul_tflop_s, device),
                "grad_norms": norms,
                "profile": prof,
            }
        except torch.OutOfMemoryError as e:
            results[f"moerl/b{b}"] = {"error": f"out of memory: {e}"[:300]}
    payload = {
        "benchmark": "train_step",
        **device_info(device),
        "spec": spec.as_dict(),
        "seq_len": seq_len,
        "dtype": str(dtype),
        "optimizer": "torch.optim.AdamW (fused on CUDA, bf16 moments), grad clip 1.0",
        "activation_checkpointing": activation_checkpointing,
        "micro_batch_size": micro_batch_size,
        "flops_per_token": flops_tok,
        "ceilings": ceilings.as_dict(),
        "results": results,
    }
    _write_json("train_step", payload, out_dir)
    _print(payload)
    return payload


def _print(p: dict) -> None:
    rows = []
    for name, r in p["results"].items():
        if "error" in r:
            rows.append([name, None, None, None, None, r["error"][:40]])
        else:
            rows.append(
                [name, r["median_step_s"], r["tokens_per_s"], r["tflop_s"], r["mfu"], r["peak_memory_gib"]]
            )
    print_table(
        f"training step, seq {p['seq_len']}, {p['spec']['name']}, {p['device']} "
        f"(matmul peak {p['ceilings']['matmul_tflop_s']:.0f} TFLOP/s)",
        ["impl/batch", "step s", "tokens/s", "TFLOP/s", "MFU", "peak GiB"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument(
        "--batches",
        type=_int_list,
        default="2",
        help="comma-separated batch sizes (transformers: the first)",
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--profile", action="store_true", help="kernel breakdown of one moerl step (CUDA)")
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="trainer.activation_checkpointing: recompute each decoder layer in the backward pass",
    )
    ap.add_argument(
        "--micro-batch-size", type=int, default=None, help="trainer.micro_batch_size (default: B)"
    )
    run(**vars(ap.parse_args(argv)))
    return 0


def _int_list(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
