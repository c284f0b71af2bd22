"""Hardware and model presets of the published runs ``moerl plan --published`` predicts: DGX H100 and H20
nodes (InfiniBand, not EFA) and Qwen2.5-7B as a dense model.

They live here, not in ``hardware.py`` / ``models.py``, because those two modules are part of the frozen
planner model (``moerl.plan.freeze.MODEL_MODULES``): adding a catalog entry there would change the model
digest and turn every held-out bench point into a seen one, although no validated prediction uses the new
entries. Importing this module adds them to ``HARDWARE`` and ``MODELS`` (``moerl.plan.inputs`` imports it,
so every ``Plan`` can name them); the frozen formulas are unchanged.

Units as ``moerl.plan.hardware`` (TFLOP/s dense, GB/s per direction, GB, USD per node-hour).
"""

from __future__ import annotations

from moerl.plan.hardware import _H100, _INT, _MSG, _NVL4, _SPOT, HARDWARE, Hardware
from moerl.plan.models import MODELS, ModelShape

_H20 = (
    "NVIDIA H20 (HGX H20 product brief, 2024): 148 TFLOP/s bf16 dense, 296 FP8 dense, 96 GB HBM3 at "
    "4.0 TB/s, NVLink 900 GB/s bidirectional"
)
_IB = "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s InfiniBand (3200 Gb/s per node, one NIC per GPU)"
_IB_H20 = (
    "assumption: an H20 node with one 400 Gb/s NIC per GPU as the HGX reference design (the verl runs do "
    "not state their NICs)"
)
_PRICE = (
    "assumption: the p5 capacity-block rate (no price is part of a published figure); override with --set"
)


def _ib_node(name: str, gpu: str, chip: str, net_src: str, **kw) -> Hardware:
    src = {
        "bf16_tflops": chip, "fp8_tflops": chip, "hbm_tb_s": chip, "hbm_gb": chip, "nvlink_gb_s": _NVL4,
        "net_gb_s": net_src, "gpus_per_node": _IB if gpu == "H100" else _IB_H20, "net_message_us": _MSG,
        "price_on_demand": _PRICE, "spot_fraction": _SPOT, "interruptions_per_hour": _INT,
    }  # fmt: skip
    return Hardware(name=name, gpu=gpu, gpus_per_node=8, net_gb_s=3200 / 8, nvlink_gb_s=450,
                    price_on_demand=39.33, sources=src, **kw)  # fmt: skip


PUBLISHED_HARDWARE: dict[str, Hardware] = {
    "dgx-h100": _ib_node("dgx-h100", "H100", _H100, _IB, bf16_tflops=989, fp8_tflops=1979, hbm_tb_s=3.35,
                         hbm_gb=80),
    "h20": _ib_node("h20", "H20", _H20, _IB_H20, bf16_tflops=148, fp8_tflops=296, hbm_tb_s=4.0, hbm_gb=96),
}  # fmt: skip
"""Nodes of the published runs: 8 GPUs, one 400 Gb/s NIC each (``net_gb_s`` 400 GB/s per node)."""

# Qwen2.5-7B config.json (huggingface.co/Qwen/Qwen2.5-7B; Qwen2.5-Math-7B has the same shapes): V 152064,
# H 3584, 28 layers, 28 query / 4 KV heads of 128, SwiGLU FFN 18944, untied embeddings: 7.6 B parameters. A
# dense model is one expert of width 18944 chosen by every token (top-1 of 1): the same parameters and FLOPs;
# its router (H x 1 per layer, 0.1 M) is the only extra term. The q/k/v biases (< 0.01%) are not counted.
PUBLISHED_MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                             num_kv_heads=4, head_dim=128, num_experts=1, top_k=1, moe_intermediate_size=18944),
}  # fmt: skip
"""Models of the published runs that ``moerl.plan.models`` lacks (its Qwen3 and DeepSeek-V3 rows serve)."""

for _name, _hw in PUBLISHED_HARDWARE.items():
    HARDWARE.setdefault(_name, _hw)
for _name, _m in PUBLISHED_MODELS.items():
    MODELS.setdefault(_name, _m)
