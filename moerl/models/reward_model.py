"""Learned reward models: Hugging Face sequence-classification folders run on moerl's own model code.

A reward model folder (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``,
``Qwen3MoeForSequenceClassification``, ... as transformers saves them) is a causal LM body (``model.*``
weights, no ``lm_head``) and a linear ``score`` head [num_labels, H] without bias. transformers applies the
head to every position and returns the row of the last non-padding token; so does ``RewardModel``: the
body is a ``MoeForCausalLM`` whose ``lm_head`` is the score head, and the score is read at the last token
the attention mask keeps.

Bodies: the MoE families moerl implements (``SUPPORTED_ARCHITECTURES`` with ``ForCausalLM`` replaced by
``ForSequenceClassification``) and the dense families of ``DENSE_BODIES`` (every layer a SwiGLU MLP,
``num_experts = 0``). Anything else is refused at load in one line.

Shape legend: B sequences, T tokens (right-padded), H hidden size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moerl.choices import SUPPORTED_ARCHITECTURES
from moerl.models.arch import UnsupportedArchitectureError
from moerl.models.checkpoint import load_tensors
from moerl.models.config import MoeConfig
from moerl.models.hf_config import hf_to_fields
from moerl.models.keymaps import ExpertSlice, KeyMapper
from moerl.models.model import MoeForCausalLM

SEQ_CLS = "ForSequenceClassification"
SCORE_KEY = "score.weight"
"""The checkpoint name of the score head [num_labels, H] (transformers' ``...ForSequenceClassification.score``)."""


@dataclass(frozen=True, slots=True)
class DenseBody:
    """How a dense family's config reads as moerl fields: its attention is Qwen3-MoE's but for these."""

    qk_norm: str
    """``head`` (Qwen3: RMSNorm over each head of q and k) or ``none`` (Llama)."""
    bias_on_output: bool
    """``attention_bias`` also puts a bias on o_proj (Llama) rather than only on q, k, v."""


DENSE_BODIES: dict[str, DenseBody] = {
    "Qwen3ForSequenceClassification": DenseBody(qk_norm="head", bias_on_output=True),
    "LlamaForSequenceClassification": DenseBody(qk_norm="none", bias_on_output=True),
}
"""Dense reward-model architectures moerl runs (every layer dense: ``num_experts = 0``)."""


def reward_architectures() -> list[str]:
    """Every ``architectures[0]`` a reward model folder may name, sorted."""
    moe = [a.replace("ForCausalLM", SEQ_CLS) for a in SUPPORTED_ARCHITECTURES]
    return sorted([*moe, *DENSE_BODIES])


def reward_body_config(d: dict[str, Any]) -> tuple[MoeConfig, int]:
    """The body's ``MoeConfig`` and ``num_labels`` of a parsed sequence-classification ``config.json``.

    Raises:
        UnsupportedArchitectureError: one line naming the architecture (not a sequence-classification
            model, or a body family moerl does not implement) and listing the supported ones, or a
            feature moerl does not run (an MLP bias, sliding windows, a rope type).
    """
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in DENSE_BODIES:
        fields = _dense_fields(d, DENSE_BODIES[arch], arch)
    elif arch and arch.endswith(SEQ_CLS) and arch.replace(SEQ_CLS, "ForCausalLM") in SUPPORTED_ARCHITECTURES:
        fields = hf_to_fields({**d, "architectures": [arch.replace(SEQ_CLS, "ForCausalLM")]})
    else:
        raise UnsupportedArchitectureError(
            f"reward model architecture {arch!r} is not supported; supported: {reward_architectures()}"
        )
    num_labels = len(d["id2label"]) if d.get("id2label") else int(d.get("num_labels", 2))
    return MoeConfig(**{**fields, "tie_word_embeddings": False}), num_labels


def _dense_fields(d: dict[str, Any], body: DenseBody, arch: str) -> dict[str, Any]:
    if d.get("mlp_bias"):
        raise UnsupportedArchitectureError(f"{arch}: mlp_bias=true is not supported")
    # read as a Qwen3-MoE config with no experts: the dense layers and attention are the same modules
    as_moe = {**d, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 1, "moe_intermediate_size": 1}
    fields = hf_to_fields(as_moe)
    bias = bool(d.get("attention_bias", False))
    fields.update(num_experts=0, qk_norm=body.qk_norm, qkv_bias=bias, o_bias=bias and body.bias_on_output)
    return fields


class _RewardKeys(KeyMapper):
    """The body's names, and ``score.weight`` for the head (held as the body's ``lm_head.weight``)."""

    def to_ours(self, hf_key: str) -> str | ExpertSlice | None:
        if hf_key == SCORE_KEY:
            return "lm_head.weight"
        if hf_key.startswith("lm_head."):
            return None  # a causal LM head in a reward folder is unexpected
        return super().to_ours(hf_key)

    def to_hf(self, name: str) -> str:
        return SCORE_KEY if name == "lm_head.weight" else super().to_hf(name)


class RewardModel(nn.Module):
    """A causal LM body with a linear score head, scored at each sequence's last real token.

    Args:
        cfg: the body (``tie_word_embeddings`` must be False: the head replaces the LM head).
        num_labels: rows of the score head; the reward is label 0 (reward models have one label).
    """

    def __init__(self, cfg: MoeConfig, num_labels: int = 1) -> None:
        super().__init__()
        if cfg.tie_word_embeddings:
            raise ValueError("a reward model body has no LM head to tie: tie_word_embeddings must be False")
        self.body = MoeForCausalLM(cfg)
        self.body.lm_head = nn.Linear(cfg.hidden_size, num_labels, bias=False)
        self.num_labels = num_labels

    @property
    def config(self) -> MoeConfig:
        """The body's config."""
        return self.body.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores [B] float32 of ``input_ids`` [B, T] int64 under ``attention_mask`` [B, T] (1 = token).

        The score is the head's label 0 at the rightmost position the mask keeps (transformers' "last
        non-pad token"). Pad on the right: positions come from the mask's cumulative sum.

        Raises:
            ValueError: a row of ``attention_mask`` keeps no token.
        """
        if not bool(attention_mask.any(-1).all()):  # device sync
            raise ValueError("every sequence needs at least one token (a row of attention_mask is all 0)")
        logits = self.body(input_ids, attention_mask).logits  # [B, T, num_labels]
        t = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (t * attention_mask.long()).argmax(-1)  # [B] rightmost kept position
        return logits[torch.arange(input_ids.shape[0], device=input_ids.device), last, 0].float()


def check_reward_folder(path: str | os.PathLike[str]) -> tuple[MoeConfig, int]:
    """Check a reward model folder without loading a tensor: config.json parses and names an architecture
    moerl runs (``reward_body_config``), and every safetensors header reads. Cheap: run it before any long
    work (``moerl train``'s preflight).

    Returns:
        ``(body config, num_labels)``.
    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ValueError: one line: config.json not JSON, an unsupported architecture
            (``UnsupportedArchitectureError``), a config value out of range, an unreadable safetensors file.
    """
    from safetensors import safe_open

    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a reward model is a Hugging Face model folder)")
    try:
        d = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    try:
        cfg, num_labels = reward_body_config(d)
    except (TypeError, KeyError) as e:
        raise ValueError(f"{cfg_file}: {type(e).__name__}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights; moerl reads safetensors only")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError (not a standard type)
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    return cfg, num_labels


def load_reward_model(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> RewardModel:
    """Load a Hugging Face sequence-classification folder (config.json + safetensors) as a ``RewardModel``.

    Raises:
        FileNotFoundError: no config.json or no safetensors file in ``path``.
        UnsupportedArchitectureError: an architecture moerl does not run (one line, lists the supported).
        moerl.models.CheckpointError: missing or unexpected weights (named), or a tensor's shape.
    """
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (reward.model_path must be a model folder)")
    cfg, num_labels = reward_body_config(json.loads(cfg_file.read_text()))
    with torch.device("meta"):
        model = RewardModel(cfg, num_labels)
    model = model.to_empty(device=device).to(dtype)
    model.body.keep_router_buffers_fp32()
    load_tensors(model.body, folder, _RewardKeys(cfg.model_type, cfg.num_hidden_layers))
    model.body.rotary = model.body.build_rotary().to(device)  # non-persistent: rebuilt after to_empty
    return model.eval()


def save_reward_model(model: RewardModel, path: str | os.PathLike[str]) -> None:
    """Write ``model`` as a Hugging Face sequence-classification folder that ``load_reward_model`` and
    transformers read: config.json (``Qwen3ForSequenceClassification`` for a dense Qwen3-MoE-layout body,
    else the family's ``...ForSequenceClassification``, ``num_labels``) and one ``model.safetensors``.

    Raises:
        ValueError: a dense body whose attention is not Qwen3's (only those have a dense family here).
    """
    from safetensors.torch import save_file

    cfg = model.config
    d = cfg.to_hf_dict()
    if cfg.num_experts == 0:
        if cfg.model_type != "qwen3_moe":
            raise ValueError(f"a dense {cfg.model_type} body has no sequence-classification family here")
        for k in ("num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            d.pop(k, None)
        d.update(architectures=["Qwen3ForSequenceClassification"], model_type="qwen3")
    else:
        d["architectures"] = [cfg.architecture.replace("ForCausalLM", SEQ_CLS)]
    d.update(num_labels=model.num_labels, id2label={str(i): f"LABEL_{i}" for i in range(model.num_labels)})
    d["label2id"] = {v: int(k) for k, v in d["id2label"].items()}
    mapper = _RewardKeys(cfg.model_type, cfg.num_hidden_layers)
    tensors = {}
    for name, t in model.body.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = int(name.split(".")[1])
            for e in range(t.shape[0]):
                if name.endswith("down_proj"):
                    tensors[mapper.expert_key(layer, e, "down")] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    tensors[mapper.expert_key(layer, e, "gate")] = gate.clone()
                    tensors[mapper.expert_key(layer, e, "up")] = up.clone()
        else:
            tensors[mapper.to_hf(name)] = t.clone()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(d, indent=2))


def pad_right(
    sequences: Sequence[Sequence[int]], device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T] int64, attention_mask [B, T] int64)`` of token-id lists, padded on the right
    with 0 to the longest (T)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def score_sequences(
    model: RewardModel, sequences: Sequence[Sequence[int]], *, batch_size: int
) -> list[float]:
    """Reward of each token-id sequence (prompt + response), ``batch_size`` sequences per forward.

    Sequences are grouped by length (fewer pad tokens); the result is in input order.

    Raises:
        ValueError: an empty sequence, a token id outside the model's vocabulary, or ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    vocab = model.config.vocab_size
    for s in sequences:
        if not s or min(s) < 0 or max(s) >= vocab:
            raise ValueError(f"a sequence of {len(s)} tokens is empty or has ids outside [0, {vocab})")
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = [0.0] * len(sequences)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = pad_right([sequences[i] for i in idx], device)
        for i, s in zip(idx, model(ids, mask).tolist(), strict=True):
            out[i] = s
    return out
