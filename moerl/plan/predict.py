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
- Weight sync per policy version: the rollout copy of the weights (``weight_bytes`` per parameter) streamed
  to every rollout node from a broadcast tree: (bytes / ``rollout_ep_nodes``) / node EFA bandwidth; the
  rollout pauses for (1 - ``sync_overlap``) of it.
- Checkpoint every ``checkpoint_every`` steps: params x ``checkpoint_bytes_per_param`` written by the
  training nodes at ``storage_gb_s_per_node`` each; training blocks for it.
- Spot: a replica of n nodes is interrupted at rate n lambda; with a notice of s seconds a sequence with
  remaining time u > s is lost, u ~ U[0, t_seq]: lost replica-seconds (t_seq - s)^2 / (2 t_seq), then the
  replica is down for ``replace_s`` (new instance, weights reloaded). Availability = 1 - n lambda (lost + down),
  a first-order model: a plan where it is <= 0 is a ConfigError, not a figure.
- Async: useful episodes/s = min(rollout supply, training demand) (the staleness gate throttles the faster
  side); sync: one batch generated, then trained: episodes / (t_gen + t_train + t_sync).
- Cost per hour = train nodes x on-demand + rollout nodes x (Spot or on-demand); $ per useful episode = cost
  per second / useful episodes per second; per converged policy = ``steps_to_converge`` x episodes per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from moerl.configlib import ConfigError
from moerl.ep import ExpertPlacement, Topology
from moerl.plan import calibrate, timing
from moerl.plan.hardware import get_hardware
from moerl.plan.inputs import Plan, parse_param, set_param, with_params
from moerl.plan.models import get_model
from moerl.plan.traffic import RowBytes, expected_traffic
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
    usd_per_hour: float
    usd_per_episode: float
    usd_per_1000_episodes: float
    usd_per_converged_policy: float


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


def _replica(p: Plan, hw, m, cal: dict, dispatcher: str) -> tuple[float, float, float]:
    """(rollout tok/s of the whole rollout fleet, decode step s, EP s per step; plus MB/layer) of one dispatcher."""
    g, r = hw.gpus_per_node, hw.gpus_per_node * p.rollout_ep_nodes
    c = calibrate.constants(cal)
    ctx = p.prompt_len + 0.5 * p.response_len * (1 + p.response_cv**2)
    rows = RowBytes(hidden=int(m.hidden_size * p.dispatch_bytes), top_k=m.top_k)
    placement = ExpertPlacement(
        m.num_experts, Topology(r, g), "contiguous" if p.placement == "grouped" else "round_robin"
    )
    ep_rt, inter = (
        (0.0, 0.0) if r == 1 else _ep_s(p, hw, placement, p.rollout_rows_per_gpu, rows, dispatcher, cal)
    )
    step = (
        timing.decode_step_s(m, hw, c, p.rollout_rows_per_gpu, ctx, r, p.weight_bytes)
        + (1 - p.ep_overlap) * m.num_moe_layers * ep_rt
    )
    prefill_tokens = p.rollout_rows_per_gpu * p.prompt_len
    prefill = timing.prefill_s(m, hw, c, prefill_tokens, p.prompt_len, p.weight_bytes)
    if r > 1:  # prefill's MoE layers dispatch too, in chunks of at most PREFILL_CHUNK tokens per GPU
        chunk = min(prefill_tokens, PREFILL_CHUNK)
        rt = _ep_s(p, hw, placement, chunk, rows, dispatcher, cal)[0]
        prefill += (1 - p.ep_overlap) * m.num_moe_layers * rt * prefill_tokens / chunk
    per_gpu = p.rollout_rows_per_gpu * p.response_len / (prefill + p.response_len * step)
    return per_gpu * g * p.rollout_nodes, step, m.num_moe_layers * ep_rt, inter


def _train_step_s(p: Plan, hw, m, cal: dict, dispatcher: str) -> float:
    c = calibrate.constants(cal)
    gpus = p.train_nodes * hw.gpus_per_node
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
    return (
        timing.train_compute_s(m, hw, c, tokens, seq)
        + timing.optimizer_s(hw, c, local)
        + (1 - p.ep_overlap) * 2 * m.num_moe_layers * rt
        + reduce
    )


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
    episodes = p.prompts_per_step * p.group_size
    sync_s = m.num_params * p.weight_bytes / p.rollout_ep_nodes / (p.net_fraction * hw.net_gb_s * 1e9)
    ckpt_s = m.num_params * p.checkpoint_bytes_per_param / (p.train_nodes * p.storage_gb_s_per_node * 1e9)
    lam = hw.interruptions_per_hour / 3600 * p.rollout_ep_nodes if p.spot_rollout else 0.0
    out = []
    for disp in DISPATCHERS:
        tok_s, step, ep_s, inter = _replica(p, hw, m, cal, disp)
        t_train = _train_step_s(p, hw, m, cal, disp) + ckpt_s / p.checkpoint_every
        t_seq = p.response_len * step
        lost = max(0.0, t_seq - p.notice_s) ** 2 / (2 * t_seq)
        avail = 1 - lam * (lost + p.replace_s)
        if avail <= 0:  # Plan checks n lambda replace_s < 1; the lost work of long sequences adds to it
            raise ConfigError(
                f"Spot: availability 1 - n lambda (lost {lost:.0f} s + replace_s {p.replace_s:g} s) = {avail:.2f}"
                " <= 0; lower interruptions_per_hour or replace_s, or raise notice_s"
            )
        t_gen = episodes * p.response_len / (tok_s * avail)
        supply = episodes / (t_gen + (1 - p.sync_overlap) * sync_s)
        demand = episodes / t_train
        sync_iter = t_gen + t_train + sync_s
        is_async = p.mode == "async" and p.max_staleness >= 1  # staleness 0: the trainer waits for fresh data
        useful = min(supply, demand) if is_async else episodes / sync_iter
        price_roll = hw.price_spot if p.spot_rollout else hw.price_on_demand
        usd_h = p.train_nodes * hw.price_on_demand + p.rollout_nodes * price_roll
        per_ep = usd_h / 3600 / useful
        out.append(Prediction(disp, p.train_nodes, 1e3 * step, 1e3 * ep_s, inter / 1e6, tok_s * avail, t_train, sync_s,
                              ckpt_s / p.checkpoint_every, avail, supply, demand, useful, supply / demand,
                              episodes / min(supply, demand), sync_iter, usd_h, per_ep, 1e3 * per_ep,
                              per_ep * episodes * p.steps_to_converge))  # fmt: skip
    return out


def _check_fits(p: Plan, hw, m) -> None:
    """Raise ConfigError when the rollout replica's weights or the training state do not fit in HBM."""
    r = hw.gpus_per_node * p.rollout_ep_nodes
    per_gpu = p.weight_bytes * (m.non_expert_params + m.routed_expert_params / r) / 1e9
    if per_gpu > 0.9 * hw.hbm_gb:
        raise ConfigError(
            f"rollout weights need {per_gpu:.0f} GB per GPU of {hw.hbm_gb:g}; raise rollout_ep_nodes"
        )
    train = m.num_params * (2 + 2 + 4 + 4) / (p.train_nodes * hw.gpus_per_node) / 1e9
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
