"""Learned reward scoring throughput: a ~1 B reward model in a run's scoring path against its forward alone.

    python3 bench/reward_gpu.py --out bench/results/reward_gpu.json            # GPU, the issue's figure
    python3 bench/reward_gpu.py --tiny --out /tmp/reward_tiny.json              # CPU smoke (tiny model)

The model: a dense Qwen3-layout body (hidden 2048, 18 layers, 16 heads / 8 KV heads of 128, MLP 6144,
vocabulary 32000: 0.97 B parameters) with a one-label score head, random weights, saved as a Hugging Face
``Qwen3ForSequenceClassification`` folder and loaded with ``moerl.models.reward_model.load_reward_model``
in bfloat16 on CUDA (float32 on CPU). Sequences: ``--prompt-len`` prompt + ``--response-len`` response
tokens, uniform random ids, in groups of ``--group-size``.

- ``forward``: ``score_sequences`` over all sequences in this process, ``--batch-size`` per forward
  (the model's throughput alone).
- ``in_run``: the async run's path. ``--deliveries`` concurrent threads (the exchange's, one per
  rollout worker delivery) each call ``score_groups`` on ``Group`` records through a ``RayRewardPool``
  of ``--workers`` reward worker actors (``1 / workers`` of the GPU each), which cuts batches, sends
  them to the actors, gathers scores and mixes them with the verifiable rewards (``reward.combine:
  sum``, ``normalize: group``).

sequences/s = sequences / wall seconds, median of ``--runs`` runs after one warm-up run. Writes ``--out``
(JSON): both rates, their ratio, the settings and the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moerl.config_reward import RewardConfig  # noqa: E402
from moerl.models.config import MoeConfig  # noqa: E402
from moerl.models.reward_model import RewardModel, load_reward_model, save_reward_model, score_sequences  # noqa: E402
from moerl.records import Group, RolloutTask, Sample  # noqa: E402
from moerl.runtime.reward import score_groups  # noqa: E402

ONE_B = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=18, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, intermediate_size=6144)  # fmt: skip
TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=64)  # fmt: skip


def build_folder(spec: dict, folder: Path) -> int:
    """Save a random reward model of ``spec`` (dense Qwen3 layout) to ``folder``; returns its parameters."""
    torch.manual_seed(0)
    cfg = MoeConfig(**spec, num_experts=0, qk_norm="head", max_position_embeddings=4096, pad_token_id=0)
    model = RewardModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)
    save_reward_model(model, folder)
    return sum(p.numel() for p in model.parameters())


def make_groups(
    num_groups: int, group_size: int, prompt_len: int, response_len: int, vocab: int
) -> list[Group]:
    """Groups of random prompt + response ids (verifiable reward 0 or 1), as a rollout worker delivers."""
    gen = torch.Generator().manual_seed(1)
    groups = []
    for g in range(num_groups):
        prompt = tuple(torch.randint(1, vocab, (prompt_len,), generator=gen).tolist())
        task = RolloutTask(
            task_id=f"{g}:0", prompt_ids=prompt, prompt_text="", answer="", num_samples=group_size
        )
        samples = []
        for i in range(group_size):
            resp = tuple(torch.randint(1, vocab, (response_len,), generator=gen).tolist())
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, response_logprobs=(0.0,) * response_len,
                                  loss_mask=(1,) * response_len, finish_reason="length",
                                  policy_versions=(0,) * response_len, reward=float(i % 2)))  # fmt: skip
        groups.append(Group(task=task, lease_token=1, worker_id="bench", samples=tuple(samples),
                            min_policy_version=0, gen_seconds=0.0,
                            num_tokens=group_size * (prompt_len + response_len)))  # fmt: skip
    return groups


def _timed(fn, runs: int) -> float:
    fn()  # warm-up (CUDA kernels, actors' model load)
    times = []
    for _ in range(runs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_forward(folder: Path, groups: list[Group], batch_size: int, device: str, dtype, runs: int) -> float:
    """sequences/s of ``score_sequences`` alone, in this process."""
    model = load_reward_model(folder, dtype=dtype, device=device)
    seqs = [list(s.prompt_ids) + list(s.response_ids) for g in groups for s in g.samples]
    secs = _timed(lambda: score_sequences(model, seqs, batch_size=batch_size), runs)
    model.to("cpu")  # free the GPU for the reward workers of the in-run measurement
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return len(seqs) / secs


def bench_in_run(folder: Path, groups: list[Group], args, device: str, runs: int) -> float:
    """sequences/s of ``score_groups`` through reward worker actors, ``args.deliveries`` at once."""
    import ray

    from moerl.runtime.ray.reward_pool import RayRewardPool

    ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False,
             num_cpus=max(2, args.workers + 1))  # fmt: skip
    cfg = RewardConfig(model_path=str(folder), combine="sum", normalize="group", batch_size=args.batch_size,
                       num_workers=args.workers, gpus_per_worker=1.0 / args.workers, timeout_s=600,
                       dtype="bfloat16" if device == "cuda" else "float32")  # fmt: skip
    pool = RayRewardPool(cfg, device)
    shards = [groups[i :: args.deliveries] for i in range(args.deliveries)]

    def once() -> None:
        threads = [threading.Thread(target=score_groups, args=(s, pool, cfg)) for s in shards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        secs = _timed(once, runs)
    finally:
        pool.close()
        ray.shutdown()
    return sum(len(g.samples) for g in groups) / secs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke run)")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="reward worker actors sharing the GPU")
    p.add_argument("--deliveries", type=int, default=4, help="concurrent deliveries (rollout workers)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if args.tiny:
        args.groups, args.group_size, args.prompt_len, args.response_len = 4, 4, 8, 8
        args.batch_size, args.runs = 8, 1
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = TINY if args.tiny else ONE_B
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "rm"
        params = build_folder(spec, folder)
        groups = make_groups(
            args.groups, args.group_size, args.prompt_len, args.response_len, spec["vocab_size"]
        )
        forward = bench_forward(folder, groups, args.batch_size, device, dtype, args.runs)
        in_run = bench_in_run(folder, groups, args, device, args.runs)
    result = {
        "bench": "reward_gpu",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "params": params,
        "dtype": str(dtype).removeprefix("torch."),
        "sequences": args.groups * args.group_size,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "deliveries": args.deliveries,
        "forward_sequences_per_s": round(forward, 2),
        "in_run_sequences_per_s": round(in_run, 2),
        "in_run_over_forward": round(in_run / forward, 3),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
