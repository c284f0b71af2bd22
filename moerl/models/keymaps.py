"""Declarative Hugging Face <-> moerl weight-name tables, one per family.

A ``Rule`` renames a prefix (template ends with ".") or one exact key; ``{L}`` stands for a layer
index. An ``ExpertLayout`` names the per-expert tensors (``...experts.{E}.gate_proj.weight`` [I, H],
``up_proj`` [I, H], ``down_proj`` [H, I]) that are stacked into moerl's ``gate_up_proj [E, 2I, H]``
(gate rows first) and ``down_proj [E, H, I]``. The fused transformers-5 names
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are read for every family.
The first rule that maps to a moerl name is the one ``save_pretrained`` writes.

moerl names: ``embed_tokens``, ``norm``, ``lm_head``, ``layers.{L}.{input_layernorm, self_attn.*,
post_attention_layernorm}``, dense ``layers.{L}.mlp.{gate,up,down}_proj``, MoE
``layers.{L}.mlp.{router.weight, router.e_score_correction_bias, experts.gate_up_proj,
experts.down_proj, shared_experts.*, shared_expert_gate.weight}``; multi-token prediction
``mtp_layers.{j}.{enorm, hnorm, eh_proj, shared_head.norm}`` and ``mtp_layers.{j}.block.*`` (a decoder
layer's names) <-> the release's ``model.layers.{N + j}.*`` (N = ``num_hidden_layers``), whose
``embed_tokens`` and ``shared_head.head`` copies of the shared embedding and head are read past.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    """Checkpoint name template -> moerl name template (prefixes when they end with '.')."""

    hf: str
    ours: str


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Per-expert checkpoint tensors of layer L, expert E: ``{prefix}.{E}.{gate|up|down}.weight``."""

    prefix: str
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True, slots=True)
class KeyTable:
    """All the names of one family."""

    rules: tuple[Rule, ...]
    experts: ExpertLayout
    ignore: tuple[str, ...] = ()
    """Regexes of checkpoint keys that are read past silently (e.g. rotary caches)."""
    skip_extra_layers: bool = False
    """Layers >= num_hidden_layers are multi-token-prediction heads (DeepSeek-V3, GLM-4.5): skipped."""


_COMMON = (
    Rule("model.embed_tokens.", "embed_tokens."),
    Rule("model.norm.", "norm."),
    Rule("lm_head.", "lm_head."),
    Rule("model.layers.{L}.input_layernorm.", "layers.{L}.input_layernorm."),
    Rule("model.layers.{L}.post_attention_layernorm.", "layers.{L}.post_attention_layernorm."),
    Rule("model.layers.{L}.self_attn.", "layers.{L}.self_attn."),
    Rule("model.layers.{L}.mlp.gate_proj.", "layers.{L}.mlp.gate_proj."),
    Rule("model.layers.{L}.mlp.up_proj.", "layers.{L}.mlp.up_proj."),
    Rule("model.layers.{L}.mlp.down_proj.", "layers.{L}.mlp.down_proj."),
)
_ROUTER = Rule("model.layers.{L}.mlp.gate.", "layers.{L}.mlp.router.")
_FUSED = (
    Rule("model.layers.{L}.mlp.experts.gate_up_proj", "layers.{L}.mlp.experts.gate_up_proj"),
    Rule("model.layers.{L}.mlp.experts.down_proj", "layers.{L}.mlp.experts.down_proj"),
)
_SHARED_EXPERTS = Rule("model.layers.{L}.mlp.shared_experts.", "layers.{L}.mlp.shared_experts.")
_IGNORE = (r".*rotary_emb\.inv_freq$",)
_MLP_EXPERTS = ExpertLayout("model.layers.{L}.mlp.experts")

KEY_TABLES: dict[str, KeyTable] = {
    "qwen3_moe": KeyTable(rules=(*_COMMON, _ROUTER, *_FUSED), experts=_MLP_EXPERTS, ignore=_IGNORE),
    "olmoe": KeyTable(rules=(*_COMMON, _ROUTER, *_FUSED), experts=_MLP_EXPERTS, ignore=_IGNORE),
    "qwen2_moe": KeyTable(
        rules=(
            *_COMMON,
            _ROUTER,
            *_FUSED,
            Rule("model.layers.{L}.mlp.shared_expert.", "layers.{L}.mlp.shared_experts."),
            Rule("model.layers.{L}.mlp.shared_expert_gate.", "layers.{L}.mlp.shared_expert_gate."),
        ),
        experts=_MLP_EXPERTS,
        ignore=_IGNORE,
    ),
    "mixtral": KeyTable(
        rules=(
            *_COMMON,
            Rule("model.layers.{L}.block_sparse_moe.gate.", "layers.{L}.mlp.router."),
            _ROUTER,
            *_FUSED,
        ),
        experts=ExpertLayout("model.layers.{L}.block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
        ignore=_IGNORE,
    ),
    "deepseek_v3": KeyTable(
        rules=(*_COMMON, _ROUTER, *_FUSED, _SHARED_EXPERTS),
        experts=_MLP_EXPERTS,
        ignore=_IGNORE,
        skip_extra_layers=True,
    ),
    "glm4_moe": KeyTable(
        rules=(*_COMMON, _ROUTER, *_FUSED, _SHARED_EXPERTS),
        experts=_MLP_EXPERTS,
        ignore=_IGNORE,
        skip_extra_layers=True,
    ),
}


@dataclass(frozen=True, slots=True)
class ExpertSlice:
    """One per-expert checkpoint tensor's place in a stacked moerl tensor."""

    name: str
    """moerl name: ``layers.{L}.mlp.experts.gate_up_proj`` or ``...down_proj`` (with ``_scale_inv``: the
    FP8 block scales of an ``Fp8Experts``, from ``...experts.{E}.gate_proj.weight_scale_inv``)."""
    expert: int
    part: str
    """gate, up or down."""


def _template_regex(template: str) -> re.Pattern[str]:
    body = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile("^" + body + ("(?P<rest>.+)$" if template.endswith(".") else "$"))


MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
"""The MTP layer's own tensors under ``model.layers.{N + j}.`` (same names in moerl's ``mtp_layers.{j}.``)."""
MTP_SHARED = ("embed_tokens.", "shared_head.head.")
"""The release's copies of the shared embedding and output head in each MTP layer."""
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class KeyMapper:
    """Translate checkpoint keys of one family to moerl names and back (see the module docstring).

    Args:
        model_type: the family (a ``KEY_TABLES`` key).
        num_hidden_layers: N, decoder layers; checkpoint layers N .. N + num_mtp_layers - 1 are MTP layers.
        num_mtp_layers: MTP depths the model has (``MoeConfig.num_nextn_predict_layers``).
    """

    def __init__(self, model_type: str, num_hidden_layers: int, num_mtp_layers: int = 0) -> None:
        self.table = KEY_TABLES[model_type]
        self.num_layers = num_hidden_layers
        self.num_mtp = num_mtp_layers
        self._hf = [(_template_regex(r.hf), r) for r in self.table.rules]
        self._ours = [(_template_regex(r.ours), r) for r in self.table.rules]
        ex = self.table.experts
        self._expert = re.compile(
            "^"
            + re.escape(ex.prefix).replace(r"\{L\}", r"(?P<L>\d+)")
            + r"\.(?P<E>\d+)\.(?P<part>[^.]+)\.weight(?P<scale>_scale_inv)?$"
        )
        self._parts = {ex.gate: "gate", ex.up: "up", ex.down: "down"}
        self._ignore = [re.compile(p) for p in self.table.ignore]

    def is_ignored(self, hf_key: str) -> bool:
        """Whether the checkpoint key is read past (rotary caches, multi-token-prediction layers)."""
        if any(p.match(hf_key) for p in self._ignore):
            return True
        m = _LAYER_KEY.match(hf_key)
        if not m or int(m.group(1)) < self.num_layers:
            return False
        if int(m.group(1)) < self.num_layers + self.num_mtp:
            return m.group(2).startswith(MTP_SHARED)
        return self.table.skip_extra_layers

    def to_ours(self, hf_key: str) -> str | ExpertSlice | None:
        """The moerl name (or per-expert slice) of a checkpoint key; None when no rule matches."""
        m = _LAYER_KEY.match(hf_key)
        if m and self.num_layers <= int(m.group(1)) < self.num_layers + self.num_mtp:
            return self._mtp_to_ours(int(m.group(1)), m.group(2))
        return self._main_to_ours(hf_key)

    def _mtp_to_ours(self, layer: int, rest: str) -> str | ExpertSlice | None:
        prefix = f"mtp_layers.{layer - self.num_layers}."
        if rest.startswith(MTP_OWN):
            return prefix + rest
        if rest.startswith(MTP_SHARED):
            return None
        inner = self._main_to_ours(f"model.layers.{layer}.{rest}")
        if inner is None:
            return None
        name = inner.name if isinstance(inner, ExpertSlice) else inner
        ours = prefix + "block." + name.removeprefix(f"layers.{layer}.")
        return ExpertSlice(ours, inner.expert, inner.part) if isinstance(inner, ExpertSlice) else ours

    def checkpoint_layer(self, name: str) -> int:
        """The checkpoint layer index of a moerl ``layers.{L}.*`` or ``mtp_layers.{j}.*`` name (N + j)."""
        parts = name.split(".")
        return int(parts[1]) + (self.num_layers if parts[0] == "mtp_layers" else 0)

    def _main_to_ours(self, hf_key: str) -> str | ExpertSlice | None:
        m = self._expert.match(hf_key)
        if m and m.group("part") in self._parts:
            part = self._parts[m.group("part")]
            proj = ("down_proj" if part == "down" else "gate_up_proj") + (m.group("scale") or "")
            return ExpertSlice(f"layers.{m.group('L')}.mlp.experts.{proj}", int(m.group("E")), part)
        for rx, rule in self._hf:
            m = rx.match(hf_key)
            if m:
                return _fill(rule.ours, m)
        return None

    def to_hf(self, name: str) -> str:
        """The checkpoint key ``save_pretrained`` writes for a (non-expert) moerl name.

        Raises:
            KeyError: no rule of this family covers the name.
        """
        if name.startswith("mtp_layers."):
            layer = self.checkpoint_layer(name)
            rest = name.split(".", 2)[2]
            if rest.startswith("block."):
                return self.to_hf(f"layers.{layer}.{rest.removeprefix('block.')}")
            return f"model.layers.{layer}.{rest}"
        for rx, rule in self._ours:
            m = rx.match(name)
            if m:
                return _fill(rule.hf, m)
        raise KeyError(f"no checkpoint name for moerl tensor {name!r}")

    def expert_key(self, layer: int, expert: int, part: str) -> str:
        """Checkpoint key of one expert's ``part`` (gate, up, down) matrix."""
        ex = self.table.experts
        proj = {"gate": ex.gate, "up": ex.up, "down": ex.down}[part]
        return f"{ex.prefix.format(L=layer)}.{expert}.{proj}.weight"


def _fill(template: str, m: re.Match[str]) -> str:
    groups = m.groupdict()
    out = template.replace("{L}", groups.get("L") or "").replace("{E}", groups.get("E") or "")
    return out + (groups.get("rest") or "")
