"""Time of the pieces of one RL iteration on one GPU: decode step, prefill, EP round trip, training step.

Units: seconds, bytes, FLOP. ``Constants`` are the fractions of datasheet peaks moerl reaches and the
dispatchers' fixed costs, fitted on ``bench/results`` by ``moerl.plan.calibrate`` (``calibration.json``).

Formulas (sources):
- Roofline (Williams, Waterman, Patterson 2009, "Roofline", CACM 52(4)): a kernel takes
  max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth).
- Decode step of B rows at mean context c on one EP rank: bytes = W_rank + B c kv_bytes, with W_rank the
  non-expert weights (the input embedding reads B rows only) plus the touched experts of its E / R local
  experts, E (1 - (1 - k / E)^(B R)) / R per MoE layer; FLOPs = B (2 N + 4 L c nh hd). Step time =
  roofline + c_step (per-step fixed cost: sampler, host, graph launch) + 2 L_m EP transfers.
- Prefill of P tokens: P (2 N + 2 L P nh hd) FLOPs (causal average context P / 2) at the prefill matmul rate.
- Training step of T tokens per GPU: T (6 N + 12 L S nh hd) FLOPs (PaLM App. B) at the training matmul rate,
  plus the optimizer pass over the local parameters (read p, g, m, v, write p, m, v: ``opt_bytes_per_param``)
  at ``optimizer_hbm_fraction`` of HBM bandwidth, plus 2 EP round trips per MoE layer (forward
  dispatch + combine and their adjoints in backward), plus the data-parallel gradient reduction
  (ring all-reduce: 2 (D - 1) / D bytes per GPU; Patarasuk and Yuan 2009).
- EP transfer (one dispatch or one combine): ``call_s`` + messages x per-message cost + bytes over links
  (``max`` of the intra- and inter-node times when the implementation drives both at once, their sum
  when stages run one after the other, as moerl's do) + ``work_bytes / proc_gb_s`` (moerl's index work,
  gathers and packing, which production kernels fuse into the transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.ep.layout import Traffic
from moerl.plan.hardware import Hardware
from moerl.plan.models import ModelShape


@dataclass(frozen=True, slots=True, kw_only=True)
class EPImpl:
    """Cost model of one dispatcher implementation (a round trip = dispatch + combine)."""

    name: str
    call_s: float
    """Fixed cost of one round trip (count exchange, host syncs, launches), s."""
    proc_gb_s: float
    """Rate of the index/packing work over ``work`` bytes (inf for fused kernels), GB/s."""
    net_fraction: float
    """Achieved fraction of the EFA bandwidth."""
    nvlink_fraction: float
    """Achieved fraction of the NVLink bandwidth."""
    overlap_links: bool
    """True: intra- and inter-node transfers overlap (max); False: they add up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Constants:
    """Fitted fractions and fixed costs (``calibration.json``)."""

    decode_hbm_fraction: float
    decode_step_s: float
    prefill_matmul_fraction: float
    train_matmul_fraction: float
    moe_matmul_fraction: float
    optimizer_hbm_fraction: float
    eager_layer_s: float = 0.0
    """Extra time per layer and decode step without CUDA graphs (kernel launches)."""
    opt_bytes_per_param: float = 14.0
    """bf16 p, g, m, v read (8 B) and p, m, v written (6 B): moerl's fused AdamW with bf16 moments."""


def ep_transfer_s(traffic: Traffic, work_bytes: float, hw: Hardware, impl: EPImpl, message_s: float) -> float:
    """Seconds of one dispatch or combine on one GPU (module docstring); ``traffic`` as ``moerl.ep.Traffic``
    (float counts allowed), ``message_s`` the per-message cost of the inter-node fabric."""
    inter = traffic.inter_node_bytes / (impl.net_fraction * hw.net_gb_s_per_gpu * 1e9)
    intra = traffic.intra_node_bytes / (impl.nvlink_fraction * hw.nvlink_gb_s * 1e9)
    wire = max(inter, intra) if impl.overlap_links else inter + intra
    msgs = traffic.inter_node_messages * message_s + traffic.intra_node_messages * message_s / 4
    return impl.call_s / 2 + msgs + wire + work_bytes / (impl.proc_gb_s * 1e9)


def decode_weight_bytes(m: ModelShape, rows_per_rank: float, ep_size: int, elem_bytes: float) -> float:
    """Weight bytes one EP rank reads in a decode step of ``rows_per_rank`` rows (module docstring)."""
    experts_local = m.experts_touched(rows_per_rank * ep_size) / ep_size
    dense = m.non_expert_params - m.vocab_size * m.hidden_size * (0 if m.tie_embeddings else 1)
    return elem_bytes * (dense + m.num_moe_layers * experts_local * m.expert_params)


def decode_step_s(
    m: ModelShape, hw: Hardware, c: Constants, rows: float, context: float, ep_size: int, elem_bytes: float
) -> float:
    """Decode step without EP traffic: roofline of bytes and FLOPs plus the per-step fixed cost."""
    mem = decode_weight_bytes(m, rows, ep_size, elem_bytes) + rows * context * m.kv_bytes_per_token(
        elem_bytes
    )
    t_mem = mem / (c.decode_hbm_fraction * hw.hbm_tb_s * 1e12)
    peak = hw.fp8_tflops if elem_bytes <= 1 else hw.bf16_tflops
    t_flop = rows * m.forward_flops_per_token(context) / (c.prefill_matmul_fraction * peak * 1e12)
    return max(t_mem, t_flop) + c.decode_step_s


def prefill_s(
    m: ModelShape, hw: Hardware, c: Constants, tokens: float, prompt_len: float, elem_bytes: float
) -> float:
    """Prefill of ``tokens`` prompt tokens (prompts of ``prompt_len``), compute-bound."""
    peak = hw.fp8_tflops if elem_bytes <= 1 else hw.bf16_tflops
    return tokens * m.forward_flops_per_token(prompt_len / 2) / (c.prefill_matmul_fraction * peak * 1e12)


def train_compute_s(m: ModelShape, hw: Hardware, c: Constants, tokens: float, seq_len: float) -> float:
    """Forward + backward FLOPs of ``tokens`` tokens on one GPU at the training matmul rate."""
    return tokens * m.train_flops_per_token(seq_len) / (c.train_matmul_fraction * hw.bf16_tflops * 1e12)


def optimizer_s(hw: Hardware, c: Constants, local_params: float) -> float:
    """One optimizer pass over ``local_params`` parameters (plus the step's other fixed work, fitted)."""
    return local_params * c.opt_bytes_per_param / (c.optimizer_hbm_fraction * hw.hbm_tb_s * 1e12)


def allreduce_s(nbytes: float, group: int, bw_gb_s: float, fraction: float = 0.8) -> float:
    """Ring all-reduce of ``nbytes`` over ``group`` GPUs at ``bw_gb_s`` per GPU: 2 (D - 1) / D bytes each."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / (fraction * bw_gb_s * 1e9)
