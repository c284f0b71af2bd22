"""The trained policy as a Hugging Face folder, written from the shards by streaming tensors.

Rank 0 receives the full tensors one at a time (``iter_full_tensors``: every rank takes part in each
gather), renames them to the checkpoint layout ``moerl.models.save_pretrained`` writes (experts split
per expert, as transformers writes them) and writes one safetensors file per bucket of
``runtime.publish_bucket_mb``, then the index and config.json. No process holds more than one bucket
of full tensors. The driver adds the tokenizer and renames the folder into place (atomic).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.models.checkpoint import INDEX_FILE
from moerl.models.keymaps import KeyMapper
from moerl.trainer.distributed.publish import iter_full_tensors, plan_buckets


def hf_tensors(name: str, t: torch.Tensor, mapper: KeyMapper) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint (key, tensor) pairs of one moerl state-dict tensor: expert stacks [E, ...] are split
    into per-expert gate/up [I, H] and down [H, I] matrices."""
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        layer = int(name.split(".")[1])
        for e in range(t.shape[0]):
            if name.endswith("down_proj"):
                yield mapper.expert_key(layer, e, "down"), t[e].contiguous()
            else:
                gate, up = t[e].chunk(2, dim=0)
                yield mapper.expert_key(layer, e, "gate"), gate.contiguous()
                yield mapper.expert_key(layer, e, "up"), up.contiguous()
    else:
        yield mapper.to_hf(name), t.contiguous()


def export_sharded(model: torch.nn.Module, folder: str | Path, *, is_writer: bool, bucket_bytes: int) -> None:
    """Write the sharded ``model`` as a Hugging Face folder at ``folder`` (collective; rank 0 writes).

    ``folder`` must be a fresh (temporary) folder; the caller renames it into place.
    """
    cfg = model.config
    mapper = KeyMapper(cfg.model_type, cfg.num_hidden_layers)
    plan = plan_buckets(model, bucket_bytes)
    tensors = iter_full_tensors(model)
    folder = Path(folder)
    weight_map, total = {}, 0
    dtype = None
    for i, names in enumerate(plan):
        bucket = {}
        for _ in names:
            name, t = next(tensors)
            dtype = dtype or (t.dtype if t.is_floating_point() else None)
            if is_writer and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
                bucket.update(hf_tensors(name, t, mapper))
        if not is_writer:
            continue
        fname = "model.safetensors" if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(bucket, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(bucket, fname))
        total += sum(v.numel() * v.element_size() for v in bucket.values())
    if not is_writer:
        return
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    hf = cfg.to_hf_dict()
    hf["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
