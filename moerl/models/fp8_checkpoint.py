"""Writing a model folder in the DeepSeek-V3 FP8 release format (``moerl.models.fp8``).

``from_pretrained`` reads such folders (dequantized, or as FP8 with ``fp8=True``); this writer makes
them from a full-precision model, for tests and benchmarks of the release path without a 671 B download.
The release quantizes every linear projection of the decoder layers (attention, dense MLP, shared and
routed experts, per expert); embeddings, norms, the router and the LM head stay in the model dtype.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.models.checkpoint import INDEX_FILE, _hf_tensors, _shards
from moerl.models.fp8 import RELEASE_QUANTIZATION, SCALE_SUFFIX, quantize_blockwise
from moerl.models.model import MoeForCausalLM

_RELEASE_KEY = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
"""Checkpoint keys the release stores in FP8 (2-D projection weights of the decoder layers)."""


def release_tensors(model: MoeForCausalLM) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors in the release format: each projection ``...X_proj.weight`` [N, K]
    as float8_e4m3fn with ``...X_proj.weight_scale_inv`` [ceil(N/128), ceil(K/128)] float32
    (``quantize_blockwise``), every other tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    for key, t in _hf_tensors(model).items():
        if _RELEASE_KEY.match(key) and t.dim() == 2:
            q, s = quantize_blockwise(t)
            out[key], out[key + SCALE_SUFFIX] = q, s
        else:
            out[key] = t
    return out


def save_fp8_release(
    model: MoeForCausalLM, path: str | os.PathLike[str], *, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``model`` as an FP8 release folder: config.json with ``quantization_config``
    (``RELEASE_QUANTIZATION``) and ``release_tensors`` in safetensors (shards with an index above
    ``max_shard_bytes``; a weight and its scales may land in different shards, as in the release).

    Raises:
        TypeError: ``model`` is not a ``MoeForCausalLM``.
    """
    if not isinstance(model, MoeForCausalLM):
        raise TypeError(f"save_fp8_release needs a MoeForCausalLM, got {type(model).__name__}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    shards = _shards(release_tensors(model), max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    cfg = model.config.to_hf_dict()
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = dict(RELEASE_QUANTIZATION)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
