"""Hugging Face checkpoint folders: ``from_pretrained`` reads, ``save_pretrained`` writes (safetensors only).

A folder holds ``config.json`` and ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (or, without an index, every ``*.safetensors`` file). Expert weights
are read per expert (``experts.N.gate_proj.weight``) or fused (``experts.gate_up_proj`` [E, 2I, H]),
through the family's table in ``moerl.models.keymaps``. ``save_pretrained`` writes the per-expert layout
that transformers itself writes, so both transformers 4.x and 5.x load it. No pickle is ever loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moerl.models.config import MoeConfig
from moerl.models.fp8 import (
    BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    copy_into_fp8,
    dequantize_blockwise,
    quantize_model_fp8,
    release_quantization,
)
from moerl.models.keymaps import ExpertSlice, KeyMapper
from moerl.models.model import MoeForCausalLM

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder does not match the model its config.json describes (the message says how)."""


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(
            f"{folder}: no *.safetensors weights (found {found}); moerl reads safetensors only"
        )
    return files


@dataclass
class _Coverage:
    """Which parts of each moerl tensor a checkpoint has filled."""

    filled: set[str] = field(default_factory=set)
    expert_parts: dict[str, set[tuple[int, str]]] = field(default_factory=dict)


def _copy_expert(dst: torch.Tensor, sl: ExpertSlice, src: torch.Tensor, hf_key: str) -> None:
    inter = dst.shape[1] // 2 if sl.part != "down" else dst.shape[2]
    if sl.expert >= dst.shape[0]:
        raise CheckpointError(
            f"{hf_key}: expert {sl.expert} is out of range; the config has {dst.shape[0]} experts"
        )
    target = {"gate": dst[sl.expert, :inter], "up": dst[sl.expert, inter:], "down": dst[sl.expert]}[sl.part]
    if src.shape != target.shape:
        raise CheckpointError(
            f"tensor {hf_key} has shape {tuple(src.shape)}; the config expects {tuple(target.shape)}"
        )
    target.copy_(src)


def _expected_parts(name: str, t: torch.Tensor) -> set[tuple[int, str]]:
    parts = ("down",) if name.removesuffix(SCALE_SUFFIX).endswith("down_proj") else ("gate", "up")
    return {(e, p) for e in range(t.shape[0]) for p in parts}


def _dequantized(where: dict, key: str, src: torch.Tensor) -> torch.Tensor:
    """An FP8 checkpoint tensor dequantized to float32 with its ``key + "_scale_inv"`` (the reference)."""
    scale_key = key + SCALE_SUFFIX
    if scale_key not in where:
        raise CheckpointError(f"tensor {key} is float8_e4m3fn but the checkpoint has no {scale_key}")
    try:
        return dequantize_blockwise(src, where[scale_key].get_tensor(scale_key), torch.float32)
    except ValueError as e:
        raise CheckpointError(f"tensor {scale_key}: {e}") from None


def load_tensors(model: MoeForCausalLM, folder: Path, mapper: KeyMapper, *, quantized: bool = False) -> None:
    """Copy a folder's safetensors into ``model``'s (allocated) parameters through ``mapper``'s names.

    ``mapper`` may be a ``KeyMapper`` subclass that names more tensors (the reward model's ``score``
    head, ``moerl.models.reward_model``). Every parameter must be filled and every key used. FP8 tensors
    (with their ``_scale_inv`` block scales, ``quantized``) are dequantized into full-precision targets or
    copied as they are into the FP8 buffers of an ``Fp8Linear`` / ``Fp8Experts``; full-precision tensors
    for an FP8 target are quantized (``moerl.models.fp8.copy_into_fp8``).

    Raises:
        CheckpointError: missing or unexpected weight keys (named), or a tensor of the wrong shape.
    """
    state = model.state_dict(keep_vars=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    cov, unexpected = _Coverage(), []
    with ExitStack() as stack, torch.no_grad():
        handles = [
            stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in _shard_files(folder)
        ]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 - safe_open is not a Mapping
        for key, h in where.items():
            target = mapper.to_ours(key)
            if target is None and (
                mapper.is_ignored(key) or (key == "lm_head.weight" and model.config.tie_word_embeddings)
            ):
                continue
            name = target.name if isinstance(target, ExpertSlice) else target
            if name not in state:
                if quantized and key.endswith(SCALE_SUFFIX):
                    continue  # read with its weight, which is dequantized
                unexpected.append(key)
                continue
            src = h.get_tensor(key)
            if src.dtype == FP8_DTYPE and state[name].dtype != FP8_DTYPE:
                src = _dequantized(where, key, src)
            elif state[name].dtype == FP8_DTYPE and src.dtype != FP8_DTYPE:
                if isinstance(target, ExpertSlice) or src.shape != state[name].shape:
                    raise CheckpointError(
                        f"tensor {key} is {src.dtype} {tuple(src.shape)} where the FP8 model expects "
                        f"float8_e4m3fn {tuple(state[name].shape)} with {key}{SCALE_SUFFIX}; load it with fp8=False"
                    )
                copy_into_fp8(state, name, src)
                cov.filled.update((name, name + SCALE_SUFFIX))
                continue
            if isinstance(target, ExpertSlice):
                _copy_expert(state[name], target, src, key)
                cov.expert_parts.setdefault(name, set()).add((target.expert, target.part))
                continue
            if src.shape != state[name].shape:
                raise CheckpointError(
                    f"tensor {key} (moerl {name}) has shape {tuple(src.shape)}; "
                    f"the config expects {tuple(state[name].shape)}"
                )
            state[name].copy_(src)
            cov.filled.add(name)
    if unexpected:
        raise CheckpointError(
            f"{folder}: unexpected weight keys {sorted(unexpected)[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)} total)"
        )
    _check_missing(state, cov, mapper, folder)


def _check_missing(state: dict[str, torch.Tensor], cov: _Coverage, mapper: KeyMapper, folder: Path) -> None:
    missing = []
    for name, t in state.items():
        if name in cov.filled:
            continue
        if ".experts." in name and name in cov.expert_parts:
            layer = mapper.checkpoint_layer(name)
            for e, part in sorted(_expected_parts(name, t) - cov.expert_parts[name]):
                missing.append(mapper.expert_key(layer, e, part))
        elif ".experts." in name:
            layer = mapper.checkpoint_layer(name)
            missing.append(
                f"{mapper.to_hf(name)} (or the per-expert "
                f"{mapper.expert_key(layer, 0, 'down' if 'down_proj' in name else 'gate')} ...)"
            )
        else:
            missing.append(mapper.to_hf(name))
    if missing:
        raise CheckpointError(
            f"{folder}: missing weight keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''} ({len(missing)} total)"
        )


def check_model_folder(path: str | os.PathLike[str]) -> MoeConfig:
    """Check a Hugging Face model folder the way ``from_pretrained`` reads it, without loading a tensor:
    ``config.json`` parses and names a supported architecture, and the header of every safetensors file
    (``safe_open``: the JSON header and the file size it implies, no tensor data) is readable. Cheap: run it
    before any long work (``moerl train``'s preflight, ``moerl generate``).

    Returns:
        The folder's ``MoeConfig``.
    Raises:
        FileNotFoundError: no config.json or no safetensors file (the message names the folder).
        CheckpointError: naming the file: config.json or the shard index not valid JSON, an unsupported
            architecture or a config value out of range, a shard the index lists that is missing, or a
            safetensors file whose header cannot be read (truncated, not safetensors).
    """
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    try:
        raw = _read_json(cfg_file)
        cfg = MoeConfig.from_hf_dict(raw)
        release_quantization(raw)
    except (ValueError, TypeError) as e:  # UnsupportedArchitectureError and ConfigError are ValueErrors
        raise CheckpointError(f"{cfg_file}: {str(e).splitlines()[0]}") from None
    try:
        files = _shard_files(folder)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / INDEX_FILE}: not a safetensors index ({e})") from None
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {INDEX_FILE})")
        try:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError (not a standard type)
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return cfg


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fp8: bool = False,
) -> MoeForCausalLM:
    """Load a Hugging Face model folder (config.json + safetensors, sharded or not, with or without index).

    An FP8 release (``quantization_config`` of the DeepSeek-V3 format, ``moerl.models.fp8``: float8_e4m3fn
    weights with 128 x 128 ``weight_scale_inv`` blocks) is dequantized to ``dtype`` by the reference
    dequantization (exactly ``dequantize_blockwise(w, scale_inv, dtype)``), unless ``fp8``.

    Args:
        path: the folder. dtype: parameter dtype (``e_score_correction_bias`` stays float32).
        device: where the parameters live.
        fp8: give the attention, MLP and expert projections FP8 block-quantized weights (``Fp8Linear``,
            ``Fp8Experts``; for rollout): an FP8 release's bytes and scales are kept as they are (no
            full-precision copy is ever made) when the expert width ``moe_intermediate_size`` is a
            multiple of 128 (DeepSeek-V3's 2048; else, and for a full-precision checkpoint, the model is
            loaded in ``dtype`` and then quantized, ``quantize_model_fp8``).
    Returns:
        ``MoeForCausalLM`` in eval mode.
    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        moerl.models.config.UnsupportedArchitectureError: unknown architecture (lists the supported ones).
        CheckpointError: missing or unexpected weight keys (named), or a tensor of the wrong shape (named,
            with both shapes).
        moerl.config.ConfigError: a config value out of range.
    """
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    raw = json.loads(cfg_file.read_text())
    cfg = MoeConfig.from_hf_dict(raw)
    if cfg.num_nextn_predict_layers and not _has_layer(folder, cfg.num_hidden_layers):
        cfg = cfg.replace(num_nextn_predict_layers=0)  # a copy saved without its MTP layers: none
    try:
        quantized = release_quantization(raw)
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    with torch.device("meta"):
        model = MoeForCausalLM(cfg).to(dtype)
    # the release's per-expert gate and up blocks stack into gate_up_proj's blocks only when I is a
    # multiple of the block; else the experts are dequantized and quantized again as stacked tensors
    keep_bytes = fp8 and quantized and cfg.moe_intermediate_size % BLOCK == 0
    if keep_bytes:  # the FP8 buffers are allocated as such: the release's bytes go straight in
        quantize_model_fp8(model, empty=True)
    # Allocate in the target dtype first, so that copy_ casts tensor by tensor (no full-size upcast copy).
    model = model.to_empty(device=device).keep_router_buffers_fp32()
    model.tie_weights()
    mapper = KeyMapper(cfg.model_type, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    load_tensors(model, folder, mapper, quantized=quantized)
    if fp8 and not keep_bytes:
        quantize_model_fp8(model)
    # to_empty left the non-persistent rotary buffer uninitialized: rebuild it on the target device.
    model.rotary = model.build_rotary().to(device)
    return model.eval()


def _has_layer(folder: Path, layer: int) -> bool:
    """Whether the folder's safetensors hold any ``model.layers.{layer}.`` tensor (headers only)."""
    prefix = f"model.layers.{layer}."
    for f in _shard_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            if any(k.startswith(prefix) for k in h.keys()):  # noqa: SIM118 - not a Mapping
                return True
    return False


def _hf_tensors(model: MoeForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names, experts split per expert (transformers' layout)."""
    cfg = model.config
    mapper = KeyMapper(cfg.model_type, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            layer = mapper.checkpoint_layer(name)
            for e in range(t.shape[0]):
                if name.endswith("down_proj"):
                    out[mapper.expert_key(layer, e, "down")] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[mapper.expert_key(layer, e, "gate")] = gate
                    out[mapper.expert_key(layer, e, "up")] = up
        else:
            out[mapper.to_hf(name)] = t
    for j in range(cfg.num_nextn_predict_layers):  # the release's copies of the shared embedding and head
        out[f"model.layers.{cfg.num_hidden_layers + j}.embed_tokens.weight"] = (
            model.embed_tokens.weight.detach()
        )
        out[f"model.layers.{cfg.num_hidden_layers + j}.shared_head.head.weight"] = (
            model.lm_head.weight.detach()
        )
    return {k: v.to("cpu").contiguous().clone() for k, v in out.items()}


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    return shards


def save_pretrained(
    model: MoeForCausalLM,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 2**30,
    extra: Callable[[Path], None] | None = None,
) -> None:
    """Write a Hugging Face folder (config.json + safetensors) that transformers loads, atomically.

    Everything is written to a temporary sibling folder that is then renamed onto ``path`` (an existing
    folder at ``path`` is replaced). More than ``max_shard_bytes`` of weights are split into
    ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``. ``extra(folder)``
    writes more files into the temporary folder before the rename (e.g. ``Tokenizer.save``), so that
    readers never see the weights without them.

    Raises:
        TypeError: ``model`` is not a ``MoeForCausalLM`` (nothing is written).
    """
    if not isinstance(model, MoeForCausalLM):
        raise TypeError(f"save_pretrained needs a MoeForCausalLM, got {type(model).__name__}")
    folder = Path(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards = _shards(_hf_tensors(model), max_shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        if len(shards) > 1:
            total = sum(v.numel() * v.element_size() for s in shards for v in s.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        cfg = model.config.to_hf_dict()
        cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if extra is not None:
            extra(tmp)
        for f in tmp.iterdir():  # shared outputs: readable by all, whatever the writer's umask
            if f.is_file():
                f.chmod(0o644)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
