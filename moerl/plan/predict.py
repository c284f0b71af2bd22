"""One RL iteration on a cluster: rollout throughput, training step, balance, Spot, checkpoint, weight sync, cost.

``Plan`` (``moerl.plan.inputs``) holds every parameter, flat so that ``--sweep name=v1,v2`` reaches any of
them, each numeric one with its valid range, checked before any prediction; ``predict(plan)``
returns one ``Prediction`` per dispatcher (flat all-to-all, hierarchical). Formulas (per replica of
``rollout_ep_nodes`` nodes, R = EP ranks, B = ``rollout_rows_per_gpu`` concurrent sequences per GPU):

- Mean context of a generated token under continuous batching: P + E[r (r + 1) / 2] / E[r]
  ~ P + (E[r] / 2)(1 + cv^2) (a token at position i of a response of length r; length-biased mean).
- Rollout tok/s per replica = R B E[r] / (prefill of R B prompts + E[r] decode steps); decode step = ``timing.
  decode_step_s`` + 2 L_m EP transfers of B tokens (``traffic.expected_traffic``, group-limited routing);
  prefill = its FLOPs + the EP round trips of its B P tokens per GPU in chunks of ``PREFILL_CHUNK``.
  ``ep_overlap`` of every EP time is hidden behind compute.
- Training step over the training GPUs: tokens = prompts x group x (P + E[r]) spread evenly; EP spans the
  ``train_ep_nodes`` nodes; 2 round trips per MoE layer; FSDP traffic over the data-parallel copies
  (1.5x an all-reduce, ZeRO sec. 7.2.2).
- A rollout replica of ``rollout_tp`` GPUs (> 0) is tensor parallel instead (``_tp_step_s``): each GPU reads
  1/tp of the weights and KV and does 1/tp of the FLOPs, plus 2 NVLink all-reduces per layer.
- Weight sync per policy version: ``weight_transport`` over the plan's GPUs (``moerl.plan.transports``:
  broadcast, sharded RDMA, staged, object store, on-device; buckets, delta, FP8 requantization).
- Training adds ``logprob_passes`` forward passes (old log-probs, reference), a third of its FLOPs each.
- Checkpoint every ``checkpoint_every`` steps: params x ``checkpoint_bytes_per_param`` written by the
  training nodes at ``storage_gb_s_per_node`` each; training blocks for it.
- Spot: a replica of n nodes is interrupted at rate n lambda; with a notice of s seconds a sequence with
  remaining time u > s is lost, u ~ U[0, t_seq]: lost replica-seconds (t_seq - s)^2 / (2 t_seq) (0 with
  ``keep_partial``: the prefixes are continued), then the replica is down for ``replace_s`` (new instance,
  weights reloaded). A fraction ``hard_loss_fraction`` of interruptions has no notice: each sequence loses
  its progress since its last snapshot, ~ U[0, K step] with K = min(``snapshot_tokens``, E[r]) (K = E[r]
  without snapshots): K step / 2 replica-seconds (``lost_per_interruption_s``). Availability = 1 - n lambda
  (lost + down), a first-order model: a plan where it is <= 0 is a ConfigError, not a figure.
  ``usd_per_episode_no_snapshots`` is the same plan with ``snapshot_tokens`` = 0 (inf where its availability
  is <= 0).
- Schedules (``moerl.plan.schedules``): ``step_s`` of ``colocated`` (every GPU generates then trains), ``sync``,
  ``one_step_off`` and ``fully_async`` (the slower of rollout supply and training demand, as before);
  the schedules that generate a whole batch wait for its longest response (``gen_batch_s``, the long
  tail). Useful episodes/s = episodes / step_s; ``tokens_per_s_per_gpu`` = training tokens / (step_s x all
  GPUs), NeMo-RL's definition.
- Cost per hour = train nodes x on-demand + rollout nodes x (Spot or on-demand); $ per useful episode = cost
  per second / useful episodes per second; per converged policy = ``steps_to_converge`` x episodes per step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from math import ceil

from moerl.configlib import ConfigError
from moerl.ep import ExpertPlacement, Topology
from moerl.plan import calibrate, timing
from moerl.plan.hardware import get_hardware
from moerl.plan.inputs import Plan, parse_param, set_param, with_params
from moerl.plan.models import get_model
from moerl.plan.schedules import StepParts, batch_decode_s, step_s
from moerl.plan.traffic import RowBytes, expected_traffic
from moerl.plan.transports import FP8_BYTES, SyncSetup, SyncTime, constants_of, sync_time
from moerl.plan.validation import expected_work_bytes

__all__ = ["DISPATCHERS", "Plan", "Prediction", "as_rows", "best_split", "parse_param", "plan_hardware",
           "plan_model", "predict", "run", "set_param", "with_params"]  # fmt: skip
"""Public names; ``Plan`` and its parsers live in ``moerl.plan.inputs`` and are re-exported here."""

DISPATCHERS = ("flat", "hierarchical")
PREFILL_CHUNK = 8192
"""Tokens per GPU of one prefill (and training) EP dispatch; longer batches are dispatched in chunks."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """Outputs for one dispatcher (units in the names)."""

    dispatcher: str
    train_nodes: int
    decode_step_ms: float
    ep_ms_per_step: float
    inter_node_mb_per_layer: float
    rollout_tok_s: float
    train_step_s: float
    weight_sync_s: float
    checkpoint_s_per_step: float
    spot_availability: float
    supply_episodes_s: float
    demand_episodes_s: float
    useful_episodes_s: float
    balance: float
    """Rollout supply / training demand (1 = both busy)."""
    async_iter_s: float
    sync_iter_s: float
    schedule: str
    """The schedule ``step_s`` is for (``Plan.schedule_used``)."""
    weight_transport: str
    gen_batch_s: float
    """A whole batch generated from scratch, long tail included (``schedules.batch_decode_s``)."""
    step_s: float
    """Seconds per training step under ``schedule`` (``schedules.step_s``)."""
    tokens_per_s_per_gpu: float
    """Training tokens (prompt + response) per second per GPU of the cluster: E (P + E[r]) / (step_s G)."""
    usd_per_hour: float
    usd_per_episode: float
    usd_per_1000_episodes: float
    usd_per_converged_policy: float
    spot_lost_s: float = 0.0
    """Replica-seconds of generation lost per Spot interruption (``lost_per_interruption_s``; 0 without Spot)."""
    usd_per_episode_no_snapshots: float = 0.0
    """``usd_per_episode`` of the same plan without progress snapshots (``snapshot_tokens`` = 0)."""


def _ep_s(
    p: Plan, hw, placement: ExpertPlacement, tokens: float, rows: RowBytes, dispatcher: str, cal: dict
) -> tuple[float, float]:
    """(round-trip seconds, inter-node bytes of one dispatch) of ``tokens`` tokens per GPU."""
    groups, kept = (p.router_groups, p.topk_groups) if p.router_groups > 1 else (1, 1)
    tr = expected_traffic(placement, tokens, rows, groups, kept)
    d, c = tr[f"{dispatcher[:4]}_dispatch"], tr[f"{dispatcher[:4]}_combine"]
    flat = dispatcher == "flat"
    net = (p.flat_net_fraction or p.net_fraction) if flat else p.net_fraction
    if p.ep_impl == "kernel":
        impl = timing.EPImpl(name="kernel", call_s=2e-6 * p.kernel_call_us, proc_gb_s=float("inf"),
                             net_fraction=net, nvlink_fraction=p.nvlink_fraction, overlap_links=True)  # fmt: skip
        work = 0.0
    else:
        fit = cal["ep_impls"]["alltoall" if dispatcher == "flat" else "hierarchical"]
        impl = timing.EPImpl(name="moerl", call_s=fit["call_s"], proc_gb_s=fit["proc_gb_s"],
                             net_fraction=net, nvlink_fraction=1e9, overlap_links=False)  # fmt: skip
        work = (
            expected_work_bytes(
                "alltoall" if dispatcher == "flat" else "hierarchical", placement, tokens, rows
            )
            / 2
        )
    msg = hw.net_message_us * 1e-6 * (p.flat_message_factor if flat else 1.0)
    return timing.ep_transfer_s(d, work, hw, impl, msg) + timing.ep_transfer_s(
        c, work, hw, impl, msg
    ), d.inter_node_bytes


_EP_MEMO: dict[tuple, tuple[float, float]] = {}
"""``_ep_s`` results by their inputs: the tail of a batch asks for the same few row counts again and again
(``expected_traffic`` costs ~30 ms a call)."""


def _ep_s_memo(
    p: Plan, hw, placement: ExpertPlacement, tokens: float, rows: RowBytes, dispatcher: str, cal: dict
):
    """``_ep_s`` through ``_EP_MEMO`` (keyed on every input it reads)."""
    topo = placement.topology
    key = (hw, p.model, p.top_k, p.placement, p.router_groups, p.topk_groups, p.ep_impl, p.kernel_call_us,
           p.net_fraction, p.flat_net_fraction, p.flat_message_factor, p.nvlink_fraction, topo.world_size,
           topo.ranks_per_node, tokens, rows, dispatcher, json.dumps(cal["ep_impls"], sort_keys=True))  # fmt: skip
    if key not in _EP_MEMO:
        if len(_EP_MEMO) > 20000:
            _EP_MEMO.clear()
        _EP_MEMO[key] = _ep_s(p, hw, placement, tokens, rows, dispatcher, cal)
    return _EP_MEMO[key]


def _decode_step(
    p: Plan, hw, m, cal: dict, dispatcher: str, rows: float, ctx: float, *, ep_line: tuple | None = None
) -> tuple[float, float, float]:
    """(decode step s, EP round trip s per MoE layer, inter-node bytes per dispatch) of a rollout replica with
    ``rows`` decode rows per GPU at mean context ``ctx``: EP over ``rollout_ep_nodes`` nodes, or tensor
    parallel over ``rollout_tp`` GPUs (``_tp_step_s``). ``ep_line`` = (rows0, rt0, rows1, rt1): the round
    trip interpolated linearly in rows between two computed points (its fixed cost and its bytes), as
    the long tail asks for every row count between one and the full batch."""
    c = calibrate.constants(cal)
    if p.rollout_tp:
        return _tp_step_s(p, hw, m, c, rows * p.rollout_tp, ctx), 0.0, 0.0
    g, r = hw.gpus_per_node, hw.gpus_per_node * p.rollout_ep_nodes
    rows_b = RowBytes(hidden=int(m.hidden_size * p.dispatch_bytes), top_k=m.top_k)
    placement = ExpertPlacement(
        m.num_experts, Topology(r, g), "contiguous" if p.placement == "grouped" else "round_robin"
    )
    if r == 1:
        ep_rt, inter = 0.0, 0.0
    elif ep_line is not None:
        r0, t0, r1, t1 = ep_line
        ep_rt, inter = t0 + (t1 - t0) * (rows - r0) / (r1 - r0) if r1 != r0 else t0, 0.0
    else:
        ep_rt, inter = _ep_s_memo(p, hw, placement, rows, rows_b, dispatcher, cal)
    step = (
        timing.decode_step_s(m, hw, c, rows, ctx, r, p.weight_bytes)
        + (1 - p.ep_overlap) * m.num_moe_layers * ep_rt
    )
    return step, ep_rt, inter


def _tp_step_s(p: Plan, hw, m, c, rows: float, ctx: float) -> float:
    """Decode step of a tensor-parallel replica of ``rollout_tp`` GPUs holding ``rows`` rows in all: each GPU
    reads 1/tp of the touched weights and of the KV cache and does 1/tp of the FLOPs (Megatron-LM TP,
    Shoeybi et al. 2019, sec. 3), plus 2 all-reduces of rows x H per layer over NVLink (one message each)."""
    tp = p.rollout_tp
    mem = timing.decode_weight_bytes(m, rows, 1, p.weight_bytes) + rows * ctx * m.kv_bytes_per_token(
        p.weight_bytes
    )
    t_mem = mem / tp / (c.decode_hbm_fraction * hw.hbm_tb_s * 1e12)
    peak = hw.fp8_tflops if p.weight_bytes <= 1 else hw.bf16_tflops
    t_flop = rows * m.forward_flops_per_token(ctx) / tp / (c.prefill_matmul_fraction * peak * 1e12)
    reduce = 0.0
    if tp > 1:
        per_layer = timing.allreduce_s(rows * m.hidden_size * 2, tp, hw.nvlink_gb_s, p.nvlink_fraction)
        reduce = 2 * m.num_layers * (per_layer + hw.net_message_us * 1e-6 / 4)
    return max(t_mem, t_flop) + c.decode_step_s + reduce


def _replica_gpus(p: Plan, hw) -> int:
    """GPUs of one rollout replica."""
    return p.rollout_tp or hw.gpus_per_node * p.rollout_ep_nodes


def _prefill_s(p: Plan, hw, m, cal: dict, dispatcher: str, tokens: float) -> float:
    """Prefill of ``tokens`` prompt tokens per GPU of a replica (its MoE layers dispatch in chunks of
    ``PREFILL_CHUNK``; a TP replica splits every token's FLOPs over its GPUs, the same per-GPU time)."""
    c = calibrate.constants(cal)
    t = timing.prefill_s(m, hw, c, tokens, p.prompt_len, p.weight_bytes)
    if not p.rollout_tp and hw.gpus_per_node * p.rollout_ep_nodes > 1:
        r = hw.gpus_per_node * p.rollout_ep_nodes
        placement = ExpertPlacement(
            m.num_experts,
            Topology(r, hw.gpus_per_node),
            "contiguous" if p.placement == "grouped" else "round_robin",
        )
        rows_b = RowBytes(hidden=int(m.hidden_size * p.dispatch_bytes), top_k=m.top_k)
        chunk = min(tokens, PREFILL_CHUNK)
        rt = _ep_s_memo(p, hw, placement, chunk, rows_b, dispatcher, cal)[0]
        t += (1 - p.ep_overlap) * m.num_moe_layers * rt * tokens / chunk
    return t


def _replica(p: Plan, hw, m, cal: dict, dispatcher: str, nodes: int) -> tuple[float, float, float, float]:
    """(rollout tok/s of ``nodes`` rollout nodes, decode step s, EP s per step, inter-node MB per layer) of one
    dispatcher at full decode rows (``rollout_rows_per_gpu``)."""
    ctx = p.prompt_len + 0.5 * p.response_len * (1 + p.response_cv**2)
    step, ep_rt, inter = _decode_step(p, hw, m, cal, dispatcher, p.rollout_rows_per_gpu, ctx)
    prefill = _prefill_s(p, hw, m, cal, dispatcher, p.rollout_rows_per_gpu * p.prompt_len)
    per_gpu = p.rollout_rows_per_gpu * p.response_len / (prefill + p.response_len * step)
    return per_gpu * hw.gpus_per_node * nodes, step, m.num_moe_layers * ep_rt, inter


def _gen_batch_s(p: Plan, hw, m, cal: dict, dispatcher: str, nodes: int) -> float:
    """One step's batch generated from scratch on ``nodes`` rollout nodes, long tail included: prefill of
    each replica's prompts plus ``schedules.batch_decode_s``."""
    g = _replica_gpus(p, hw)
    replicas = max(1, nodes * hw.gpus_per_node // g)
    per_replica = p.prompts_per_step * p.group_size / replicas
    rows = p.rollout_rows_per_gpu * g

    ctx = p.prompt_len + p.response_len / 2
    lo, hi = 1 / g, min(per_replica, rows) / g  # rows per GPU at the end of the tail and at its start
    line = (
        lo,
        _decode_step(p, hw, m, cal, dispatcher, lo, ctx)[1],
        hi,
        _decode_step(p, hw, m, cal, dispatcher, hi, ctx)[1],
    )

    def step_at(replica_rows: float, ctx: float) -> float:
        return _decode_step(p, hw, m, cal, dispatcher, replica_rows / g, ctx, ep_line=line)[0]

    prefill = _prefill_s(p, hw, m, cal, dispatcher, per_replica * p.prompt_len / g)
    decode = batch_decode_s(step_at, per_replica=per_replica, rows=rows, num_responses=p.prompts_per_step * p.group_size,
                            prompt_len=p.prompt_len, mean=p.response_len, cv=p.response_cv, limit=p.max_response_len)  # fmt: skip
    return prefill + decode


def sync_setup(p: Plan, cal: dict, hw=None, m=None) -> SyncSetup:
    """The ``SyncSetup`` of one weight sync of ``p`` (colocated: every GPU both sends and receives)."""
    hw, m = hw or plan_hardware(p), m or plan_model(p)
    gpn = hw.gpus_per_node
    colocated = p.schedule_used == "colocated"
    consts = constants_of(cal)
    tensors, ffn_tensors, expert_tensors = checkpoint_tensors(m)
    g = _replica_gpus(p, hw)
    receiver = tensors if p.rollout_tp else tensors - expert_tensors + ceil(expert_tensors / g)
    return SyncSetup(
        num_params=m.num_params, wire_bytes=FP8_BYTES if p.sync_fp8 else 2.0, changed_fraction=p.sync_changed_fraction,
        is_fp8_requant=p.sync_fp8, trainer_gpus=gpn * (p.total_nodes if colocated else p.train_nodes),
        rollout_gpus=gpn * (p.total_nodes if colocated else p.rollout_nodes), replica_gpus=_replica_gpus(p, hw),
        gpus_per_node=gpn, net_gb_s=p.net_fraction * hw.net_gb_s_per_gpu, nvlink_gb_s=p.nvlink_fraction * hw.nvlink_gb_s,
        copy_gb_s=consts.copy_hbm_fraction * hw.hbm_tb_s * 1e3, storage_gb_s=p.storage_gb_s_per_node,
        message_s=hw.net_message_us * 1e-6, bucket_bytes=p.sync_bucket_mb * 2**20, is_pipelined=p.sync_pipelined,
        consts=consts, bulk_fraction=ffn_fraction(m), pp_stages=p.train_pp_stages, num_tensors=tensors,
        bulk_tensors=ffn_tensors, receiver_tensors=receiver,
    )  # fmt: skip


def ffn_fraction(m) -> float:
    """Fraction of ``m``'s parameters in FFN projections: routed experts plus the dense layers' SwiGLU FFNs,
    3 H I_d each (shared experts, attention, router, embeddings are the rest). ``nccl_reshard`` reshards
    this part shard to shard (NeMo-RL ``nccl-reshard-refit.md``, "Bulk path")."""
    ffn = m.routed_expert_params + m.num_dense_layers * 3 * m.hidden_size * m.dense_intermediate_size
    return ffn / m.num_params


def checkpoint_tensors(m) -> tuple[int, int, int]:
    """(T, FFN tensors, routed-expert tensors) of ``m`` in the Hugging Face checkpoint layout, the unit a
    weight sync gathers and loads one at a time: per layer the attention projections (GQA q, k, v, o: 4;
    MLA q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o: 7, or 5 without a q LoRA), 2 norms, and an MoE layer's
    router (1), its routed experts' gate, up and down projections (3 E) and one shared-expert MLP (3), or a
    dense layer's FFN (3); plus embedding, final norm and lm_head (untied). Biases and q/k norms (Qwen2.5,
    Qwen3: at most 3 per layer, < 1% of an MoE model's tensors) are not counted. FFN tensors are the
    routed experts' and the dense layers' (``ffn_fraction``'s part); Qwen3-30B-A3B: 48 x 391 + 3 = 18,771."""
    attn = 4 if m.attention == "gqa" else (7 if m.q_lora_rank else 5)
    experts = m.num_moe_layers * 3 * m.num_experts
    shared = m.num_moe_layers * 3 * (1 if m.num_shared_experts else 0)
    dense_ffn = m.num_dense_layers * 3
    total = m.num_layers * (attn + 2) + m.num_moe_layers + experts + shared + dense_ffn
    return total + 2 + (0 if m.tie_embeddings else 1), experts + dense_ffn, experts


def weight_sync(p: Plan, cal: dict) -> SyncTime:
    """One weight sync of ``p`` over ``p.weight_transport`` (``moerl.plan.transports``)."""
    return sync_time(sync_setup(p, cal), p.weight_transport)


def _train_step_s(p: Plan, hw, m, cal: dict, dispatcher: str, train_nodes: int) -> float:
    """Training step on ``train_nodes`` nodes plus ``logprob_passes`` forward passes over the batch (a third of
    the training FLOPs each: 2 N of 6 N, Kaplan et al. 2020 sec. 2.1; one EP round trip per MoE layer)."""
    c = calibrate.constants(cal)
    gpus = train_nodes * hw.gpus_per_node
    seq = p.prompt_len + p.response_len
    tokens = p.prompts_per_step * p.group_size * seq / gpus
    ep = min(gpus, hw.gpus_per_node * p.train_ep_nodes, m.num_experts)
    while m.num_experts % ep or gpus % ep:
        ep -= 1
    g = min(hw.gpus_per_node, ep)
    placement = ExpertPlacement(
        m.num_experts, Topology(ep, g), "contiguous" if p.placement == "grouped" else "round_robin"
    )
    rows = RowBytes(hidden=int(p.dispatch_bytes * m.hidden_size), top_k=m.top_k)
    rt = (
        0.0
        if ep == 1
        else _ep_s(p, hw, placement, min(tokens, PREFILL_CHUNK), rows, dispatcher, cal)[0]
        * tokens
        / min(tokens, PREFILL_CHUNK)
    )
    local = m.num_params / gpus  # FSDP-sharded optimizer state
    # FSDP (ZeRO-3) over bf16 parameters: non-expert ones over all GPUs, each expert shard over its gpus / ep
    # copies; 1.5x an all-reduce's volume (two all-gathers + one reduce-scatter; Rajbhandari et al. 2020, ZeRO,
    # sec. 7.2.2), once per step (micro-batches share the gathered parameters), not overlapped with compute.
    reduce = 1.5 * timing.allreduce_s(2 * m.non_expert_params, gpus, hw.net_gb_s_per_gpu, p.net_fraction)
    reduce += 1.5 * timing.allreduce_s(
        2 * m.routed_expert_params / ep, gpus // ep, hw.net_gb_s_per_gpu, p.net_fraction
    )
    compute = timing.train_compute_s(m, hw, c, tokens, seq)
    ep = (1 - p.ep_overlap) * m.num_moe_layers * rt
    passes = p.logprob_passes * (compute / 3 + ep)
    return compute + timing.optimizer_s(hw, c, local) + 2 * ep + reduce + passes


def plan_hardware(p: Plan):
    """The hardware catalog entry of ``p`` with the plan's price and interruption rate where it sets them
    (``price_on_demand`` > 0, ``interruptions_per_hour`` >= 0): what ``predict`` prices and what
    ``moerl plan`` lists."""
    hw = get_hardware(p.hardware)
    if p.price_on_demand > 0:
        hw = replace(hw, price_on_demand=p.price_on_demand)
    if p.interruptions_per_hour >= 0:
        hw = replace(hw, interruptions_per_hour=p.interruptions_per_hour)
    return hw


def plan_model(p: Plan):
    """The model of ``p`` with the plan's top-k where it sets one (``top_k`` > 0)."""
    m = get_model(p.model)
    return replace(m, top_k=p.top_k) if p.top_k else m


def predict(p: Plan, cal: dict) -> list[Prediction]:
    """One ``Prediction`` per dispatcher (module docstring). Raises ConfigError for a plan that cannot fit."""
    hw, m = plan_hardware(p), plan_model(p)
    _check_fits(p, hw, m)
    return [_predict_one(p, hw, m, cal, disp) for disp in DISPATCHERS]


def _predict_one(p: Plan, hw, m, cal: dict, disp: str) -> Prediction:
    episodes = p.prompts_per_step * p.group_size
    schedule = p.schedule_used
    colocated = schedule == "colocated"
    gen_nodes, train_nodes = (p.total_nodes, p.total_nodes) if colocated else (p.rollout_nodes, p.train_nodes)
    sync_s = weight_sync(p, cal).total_s
    ckpt_s = m.num_params * p.checkpoint_bytes_per_param / (train_nodes * p.storage_gb_s_per_node * 1e9)
    lam = hw.interruptions_per_hour / 3600 * p.rollout_ep_nodes if p.spot_rollout else 0.0
    tok_s, step, ep_s, inter = _replica(p, hw, m, cal, disp, gen_nodes)
    t_train = _train_step_s(p, hw, m, cal, disp, train_nodes) + ckpt_s / p.checkpoint_every
    lost = lost_per_interruption_s(p, step)
    avail = 1 - lam * (lost + p.replace_s)
    if avail <= 0:  # Plan checks n lambda replace_s < 1; the lost work of long sequences adds to it
        raise ConfigError(
            f"Spot: availability 1 - n lambda (lost {lost:.0f} s + replace_s {p.replace_s:g} s) = {avail:.2f}"
            " <= 0; lower interruptions_per_hour or replace_s, or raise notice_s"
        )
    t_gen = episodes * p.response_len / (tok_s * avail)
    gen_batch = _gen_batch_s(p, hw, m, cal, disp, gen_nodes) / avail
    parts = StepParts(gen_batch_s=max(gen_batch, t_gen), gen_stream_s=t_gen, train_s=t_train, sync_s=sync_s)
    kw = {"sync_overlap": p.sync_overlap, "max_staleness": p.max_staleness}
    step_time = step_s(schedule, parts, **kw)
    supply = episodes / (t_gen + (1 - p.sync_overlap) * sync_s)
    demand = episodes / t_train
    useful = episodes / step_time
    price_roll = hw.price_spot if p.spot_rollout and not colocated else hw.price_on_demand
    usd_h = (p.total_nodes - p.rollout_nodes) * hw.price_on_demand + p.rollout_nodes * price_roll
    per_ep = usd_h / 3600 / useful
    tokens = episodes * (p.prompt_len + p.response_len)
    return Prediction(disp, p.train_nodes, 1e3 * step, 1e3 * ep_s, inter / 1e6, tok_s * avail, t_train, sync_s,
                      ckpt_s / p.checkpoint_every, avail, supply, demand, useful, supply / demand,
                      step_s("fully_async", parts, sync_overlap=p.sync_overlap, max_staleness=max(1, p.max_staleness)),
                      step_s("sync", parts, **kw), schedule, p.weight_transport, parts.gen_batch_s, step_time,
                      tokens / (step_time * p.total_nodes * hw.gpus_per_node), usd_h, per_ep, 1e3 * per_ep,
                      per_ep * episodes * p.steps_to_converge, lost if lam else 0.0,
                      _without_snapshots(p, cal, disp, per_ep))  # fmt: skip


def lost_per_interruption_s(p: Plan, step_s: float) -> float:
    """Expected replica-seconds of generation lost per Spot interruption (module docstring, "Spot").

    Args:
        p: the plan (``response_len`` E[r], ``notice_s`` s, ``keep_partial``, ``hard_loss_fraction`` f,
            ``snapshot_tokens`` K).
        step_s: seconds per decode step of the replica.

    Returns:
        (1 - f) x noticed + f x hard, seconds: noticed = (t_seq - s)^2 / (2 t_seq) with t_seq = E[r] step
        (a sequence with u ~ U[0, t_seq] left is lost if u > s), 0 with ``keep_partial``; hard = K step / 2
        with K = min(K, E[r]), or E[r] without snapshots (the progress since the last snapshot, uniform).
    """
    t_seq = p.response_len * step_s
    noticed = 0.0 if p.keep_partial else max(0.0, t_seq - p.notice_s) ** 2 / (2 * t_seq)
    kept_every = min(p.snapshot_tokens, p.response_len) if p.snapshot_tokens > 0 else p.response_len
    hard = kept_every * step_s / 2
    return (1 - p.hard_loss_fraction) * noticed + p.hard_loss_fraction * hard


def _without_snapshots(p: Plan, cal: dict, disp: str, per_ep: float) -> float:
    """``usd_per_episode`` with ``snapshot_tokens`` = 0 (``per_ep`` itself when the plan has none or no
    hard losses; inf when the plan without them cannot run: availability <= 0)."""
    if not (p.spot_rollout and p.snapshot_tokens > 0 and p.hard_loss_fraction > 0):
        return per_ep
    try:
        return _predict_one(
            replace(p, snapshot_tokens=0.0), plan_hardware(p), plan_model(p), cal, disp
        ).usd_per_episode
    except ConfigError:
        return float("inf")


def _check_fits(p: Plan, hw, m) -> None:
    """Raise ConfigError when the rollout replica's weights or the training state do not fit in HBM."""
    r = hw.gpus_per_node * p.rollout_ep_nodes
    per_gpu = p.weight_bytes * (m.non_expert_params + m.routed_expert_params / r) / 1e9
    if per_gpu > 0.9 * hw.hbm_gb:
        raise ConfigError(
            f"rollout weights need {per_gpu:.0f} GB per GPU of {hw.hbm_gb:g}; raise rollout_ep_nodes"
        )
    nodes = p.total_nodes if p.schedule_used == "colocated" else p.train_nodes  # colocated: every node trains
    train = m.num_params * (2 + 2 + 4 + 4) / (nodes * hw.gpus_per_node) / 1e9
    if train > 0.9 * hw.hbm_gb:
        raise ConfigError(f"training state needs {train:.0f} GB per GPU of {hw.hbm_gb:g}; raise train_nodes")


def as_rows(p: Plan, preds: list[Prediction]) -> dict:
    """The plan and its predictions, with the hierarchical / flat rollout throughput ratio per rollout node
    (equal to the fleet ratio when both dispatchers run the same split)."""
    flat, hier = preds
    per_node = [x.rollout_tok_s / (p.total_nodes - x.train_nodes) for x in (flat, hier)]
    return {"plan": asdict(p), "ratio_rollout_hier_over_flat": per_node[1] / per_node[0],
            "predictions": [asdict(x) for x in preds]}  # fmt: skip


def best_split(p: Plan, cal: dict, dispatcher: str = "hierarchical") -> tuple[int, float]:
    """(train_nodes, useful episodes/s) of the split of ``total_nodes`` that maximizes useful episodes/s."""
    best = _best_predictions(p, cal)[DISPATCHERS.index(dispatcher)]
    return best.train_nodes, best.useful_episodes_s


def _best_predictions(p: Plan, cal: dict) -> list[Prediction]:
    best: list[Prediction | None] = [None, None]
    last = ""
    for train in range(1, p.total_nodes):
        if (p.total_nodes - train) % p.rollout_ep_nodes:  # the rollout nodes are not whole replicas
            continue
        try:
            preds = predict(replace(p, train_nodes=train, train_share=0.0, auto_split=False), cal)
        except ConfigError as e:  # does not fit, or Spot availability <= 0
            last = f"train_nodes={train}: {e}"
            continue
        best = [
            x if b is None or x.useful_episodes_s > b.useful_episodes_s else b
            for x, b in zip(preds, best, strict=True)
        ]
    if best[0] is None:
        raise ConfigError(f"no split of total_nodes={p.total_nodes} fits (the last tried, {last})")
    return best


def run(p: Plan, cal: dict) -> list[Prediction]:
    """``predict``, or with ``auto_split`` each dispatcher at its own best split (``best_split``)."""
    return _best_predictions(p, cal) if p.auto_split else predict(p, cal)
