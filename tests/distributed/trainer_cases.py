"""The sharded trainer run inside a gloo world, and the one-rank reference it must equal.

A tiny Qwen3-MoE policy (2 layers, 8 experts, top-2) saved as a Hugging Face folder; 5 steps of
random GRPO groups (4 groups x 4 samples, ragged lengths); the same batches for every world size.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from _recompute import layer_forwards

from moerl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from moerl.models import build_model, from_pretrained, save_pretrained
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.trainer.batch import build_train_batch
from moerl.trainer.distributed.batching import split_by_groups
from moerl.trainer.distributed.mesh import build_mesh
from moerl.trainer.distributed.parallelize import build_sharded_policy
from moerl.trainer.distributed.publish import iter_full_tensors, publish_sharded, stream_sharded
from moerl.trainer.distributed.sharded import ShardedTrainer
from moerl.trainer.local import LocalTrainer
from moerl.weights.buckets import BucketAssembler
from moerl.weights.store import WeightStore

VOCAB = 40
STEPS = 5
MODEL = ModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
)


def trainer_config(**overrides) -> TrainerConfig:
    """The step's trainer config (lr 1e-4: 5 steps move the weights visibly; at 1e-3 Adam turns float32 rounding of near-zero expert gradients into lr-sized updates, and the relative weight error sits at the 1e-5 bound)."""
    return TrainerConfig(
        **{"lr": 1e-4, "micro_batch_size": 4, "batch_groups": 4, "steps": STEPS, **overrides}
    )


def save_policy(folder) -> None:
    """The tiny policy as a Hugging Face folder."""
    torch.manual_seed(0)
    save_pretrained(build_model(MODEL, VOCAB), folder)


def _group(rng: random.Random, index: int, step: int) -> Group:
    prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6)))
    task = RolloutTask(
        task_id=f"s{step}g{index}", prompt_ids=prompt, prompt_text="p", answer="a", num_samples=4
    )
    samples = []
    for _ in range(4):
        n = rng.randint(1, 8)
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n)),
                response_logprobs=tuple(-rng.uniform(0.5, 4.0) for _ in range(n)),
                loss_mask=(1,) * n,
                finish_reason="stop",
                policy_versions=(step,) * n,
                reward=float(rng.random() < 0.5),
            )
        )
    return Group.from_lease(Lease(task, "w", index + 1, 0.0), samples, 0.1)


def batches():
    """The 5 steps' batches (same on every call)."""
    rng = random.Random(7)
    return [build_train_batch([_group(rng, g, s) for g in range(4)], pad_id=0) for s in range(STEPS)]


def reference(folder, **overrides) -> dict:
    """One process, today's ``Trainer``: per-step pg_loss and grad_norm, final weights."""
    model = from_pretrained(folder)
    trainer = LocalTrainer(model, trainer_config(**overrides), AlgorithmConfig())
    stats = [trainer.train_step(b) for b in batches()]
    return {
        "pg_loss": [s.pg_loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "weights": {k: v.clone() for k, v in trainer.named_weights().items()},
    }


def run_sharded(
    rank: int, world: int, folder: str, ep_size: int, dispatcher: str, gpus_per_node: int, overrides: dict
) -> dict:
    """One rank of the sharded trainer on the same batches; rank 0 returns the gathered weights."""
    torch.manual_seed(0)
    mesh = build_mesh(ep_size, gpus_per_node)
    model = build_sharded_policy(folder, mesh, ep_dispatcher=dispatcher)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    trainer = ShardedTrainer(model, trainer_config(**overrides), AlgorithmConfig(), mesh)
    stats = [trainer.train_step(split_by_groups(b, world)[rank]) for b in batches()]
    weights = dict(iter_full_tensors(model))
    store = WeightStore(f"{folder}/store-{world}-{ep_size}") if rank == 0 else None
    published = publish_sharded(model, mesh, store, 5, bucket_bytes=16 * 1024)  # small buckets: many files
    return {
        "num_files": len(published.manifest.files) if published else None,
        "published": store.load(5) if store else None,
        "pg_loss": [s.pg_loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "weights": weights if rank == 0 else None,
        "local_numel": local_numel,
        "full_numel": sum(v.numel() for v in weights.values()),
    }


def layer_calls(rank: int, world: int, folder: str, overrides: dict) -> dict:
    """One step of the sharded trainer (EP 1: FSDP2 only) with its layer forwards counted
    (``_recompute.layer_forwards``): ``{"forward": {layer: calls}, "backward": {layer: calls}}``."""
    torch.manual_seed(0)
    mesh = build_mesh(1, 8)
    model = build_sharded_policy(folder, mesh, ep_dispatcher="alltoall")
    trainer = ShardedTrainer(model, trainer_config(**overrides), AlgorithmConfig(), mesh)
    with layer_forwards(model) as counts:
        trainer.train_step(split_by_groups(batches()[0], world)[rank])
    return {where: dict(c) for where, c in counts.items()}


def run_streamed(rank: int, world: int, folder: str, ep_size: int, bucket_bytes: int) -> dict:
    """The sharded trainer's 5 steps, then ``stream_sharded`` into a worker's ``BucketAssembler`` (rank 0
    keeps copies of the buckets it sends, as the object store would); rank 0 returns the assembled version."""
    torch.manual_seed(0)
    mesh = build_mesh(ep_size, 8)
    model = build_sharded_policy(folder, mesh, ep_dispatcher="alltoall")
    trainer = ShardedTrainer(model, trainer_config(), AlgorithmConfig(), mesh)
    for b in batches():
        trainer.train_step(split_by_groups(b, world)[rank])
    objects: list = []
    worker = BucketAssembler(objects.__getitem__, None, background=False)

    def send(bucket):
        objects.append(dataclasses.replace(bucket, data=bucket.data.copy()))  # put copies
        worker.offer(bucket.version, bucket.index, bucket.num_buckets, len(objects) - 1)
        return len(objects) - 1

    streamed = stream_sharded(model, mesh, 5, bucket_bytes, send)
    gathered = dict(iter_full_tensors(model))
    if rank != 0:
        return {"streamed": streamed}
    version, tensors = worker.poll(4)
    return {
        "streamed": streamed,
        "version": version,
        "assembled": {k: v.clone() for k, v in tensors.items()},
        "gathered": gathered,
    }
