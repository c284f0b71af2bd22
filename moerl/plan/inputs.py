"""``Plan``: every input of a prediction, each numeric field with its valid range, checked in one place.

Each int or float field of ``Plan`` states its valid values in ``metadata["range"]`` (a ``Range``), derived
from what the formulas of ``moerl.plan.predict`` need: fractions in [0, 1], counts >= 1, sizes and rates
> 0, times and staleness >= 0, bounds that name another field where the two must agree (train_nodes <
total_nodes). ``Plan.__post_init__`` checks them all (``check_ranges``), so a ``--set``, a ``--file`` value
and every ``--sweep`` point is refused before any prediction runs, with a one-line ConfigError naming the
field, the value and the range. ``--set``, ``--file`` and ``--sweep`` reach every field by its name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from math import ceil, inf, isfinite

from moerl.configlib import ConfigError
from moerl.plan import catalog  # noqa: F401 - registers the published runs' nodes and models
from moerl.plan.hardware import get_hardware
from moerl.plan.models import get_model
from moerl.plan.schedules import SCHEDULES
from moerl.plan.transports import LOCAL_TRANSPORTS, TRANSPORTS


@dataclass(frozen=True, slots=True)
class Range:
    """Valid values of a numeric ``Plan`` field: ``lo`` .. ``hi``, each end closed unless ``lo_open`` /
    ``hi_open``. A bound given as a string is the value of that ``Plan`` field (``"total_nodes"``) or, for
    ``"num_experts"``, the model's routed experts. ``note`` follows the range in the error message
    (units, what a sentinel value means); ``{model}`` in it is the plan's ``ModelShape``."""

    lo: float | str = -inf
    hi: float | str = inf
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def bounds(self, plan: Plan) -> tuple[float, float]:
        """(lo, hi) as numbers for ``plan``."""
        return _resolve(self.lo, plan), _resolve(self.hi, plan)

    def contains(self, value: float, plan: Plan) -> bool:
        """Whether ``value`` lies in the range for ``plan``."""
        lo, hi = self.bounds(plan)
        above = value > lo if self.lo_open else value >= lo
        below = value < hi if self.hi_open else value <= hi
        return above and below

    def describe(self, plan: Plan) -> str:
        """``in [0, 1)``, ``>= 1``, ``in [1, total_nodes=48)`` ...: the range as an error message states it."""
        lo, hi = (self._text(b, plan) for b in (self.lo, self.hi))
        if self.hi == inf:
            return "any finite number" if self.lo == -inf else f"{'>' if self.lo_open else '>='} {lo}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    @staticmethod
    def _text(bound: float | str, plan: Plan) -> str:
        value = _resolve(bound, plan)
        number = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{bound}={number}" if isinstance(bound, str) and bound != "num_experts" else number


def _resolve(bound: float | str, plan: Plan) -> float:
    if bound == "num_experts":
        return get_model(plan.model).num_experts
    return getattr(plan, bound) if isinstance(bound, str) else bound


def _in(
    lo: float | str, hi: float | str, *, lo_open: bool = False, hi_open: bool = False, note: str = ""
) -> dict:
    """Field metadata of the range lo .. hi (closed unless ``*_open``)."""
    return {"range": Range(lo, hi, lo_open, hi_open, note)}


def _ge(lo: float, note: str = "") -> dict:
    """Field metadata of the range >= lo."""
    return {"range": Range(lo, note=note)}


def _gt(lo: float, note: str = "") -> dict:
    """Field metadata of the range > lo."""
    return {"range": Range(lo, lo_open=True, note=note)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Every input of a prediction (defaults: the mission preset). Each numeric field's valid range is its
    ``metadata["range"]``; ``__post_init__`` checks names and ranges and raises ConfigError naming the field.
    """

    # The field order is the order of ``moerl plan``'s assumptions list and of the JSON/CSV columns.
    hardware: str = "p5en"
    """Node type, a ``moerl.plan.hardware.HARDWARE`` name (every node of the cluster)."""
    model: str = "glm5-744b-a40b"
    """Model shape, a ``moerl.plan.models.MODELS`` name."""
    top_k: int = field(
        default=0,
        metadata=_in(
            0,
            "num_experts",
            note=" (the routed experts of {model.name}; 0: the model's own top-{model.top_k})",
        ),
    )
    """Routed experts per token; 0 = the model's own."""
    total_nodes: int = field(
        default=48, metadata=_ge(2, note=" (at least one training and one rollout node)")
    )
    """Nodes of the cluster (training + rollout)."""
    train_nodes: int = field(default=16, metadata=_in(1, "total_nodes", hi_open=True))
    """Training nodes (derived from ``train_share`` when that is > 0); the rest are rollout nodes."""
    train_share: float = field(
        default=0.0, metadata=_in(0, 1, hi_open=True, note=" (0: train_nodes as given)")
    )
    """> 0: train_nodes = the share of total_nodes (rounded so the rollout nodes fill whole replicas, and at
    least the nodes that hold the training state); 0 = off: ``train_nodes`` is used as given (with
    ``auto_split``, the search starts from 1/3)."""
    auto_split: bool = False
    """True: each dispatcher gets the training/rollout split of total_nodes that maximizes useful episodes/s."""
    train_ep_nodes: int = field(default=1, metadata=_in(1, "train_nodes"))
    """Nodes per training EP group (the rest of the training GPUs are data/FSDP-parallel copies)."""
    train_pp_stages: int = field(default=1, metadata=_ge(1))
    """Pipeline-parallel stages of the trainer. Only ``weight_transport=nccl_reshard`` reads it (one reshard
    group per stage, a few stages at a time); the training step does not model pipeline stages."""
    rollout_ep_nodes: int = field(default=2, metadata=_ge(1))
    """Nodes per rollout replica (its EP group spans them); the rollout nodes are a multiple of it."""
    rollout_rows_per_gpu: int = field(default=128, metadata=_ge(1))
    """B: concurrent sequences per GPU in decode (continuous batching)."""
    placement: str = "grouped"
    """``grouped``: router groups map onto nodes (contiguous); ``round_robin``: expert e on rank e % R."""
    router_groups: int = field(
        default=8, metadata=_in(1, "num_experts", note=" (a divisor of the model's routed experts)")
    )
    """Gr: expert groups of group-limited routing (DeepSeek-V3 sec. 2.1.2); 1 = unrestricted top-k."""
    topk_groups: int = field(default=4, metadata=_in(1, "router_groups"))
    """M: groups a token keeps; its top-k experts lie in them (at most M E / Gr experts)."""
    ep_impl: str = "kernel"
    """``kernel``: fused dispatch kernels (DeepEP-like / NCCL); ``moerl``: moerl.ep today (fitted costs)."""
    kernel_call_us: float = field(default=30.0, metadata=_ge(0, note=" us"))
    """Fixed cost of one fused-kernel dispatch or combine call, microseconds (0 = none: a lower bound)."""
    net_fraction: float = field(default=0.8, metadata=_in(0, 1, lo_open=True))
    """Achieved fraction of EFA bandwidth (DeepEP normal kernels: 43-58 GB/s of ~50 GB/s on CX7, README)."""
    nvlink_fraction: float = field(default=0.8, metadata=_in(0, 1, lo_open=True))
    """Achieved fraction of NVLink bandwidth of the fused kernels."""
    flat_net_fraction: float = field(default=0.0, metadata=_in(0, 1, note=" (0: net_fraction)"))
    """EFA fraction of the flat all-to-all; 0 = ``net_fraction`` (same fabric efficiency for both)."""
    flat_message_factor: float = field(default=1.0, metadata=_gt(0))
    """Per-message cost of the flat all-to-all relative to the hardware's ``net_message_us`` (a ratio of two
    costs: > 0, since 0 would make the flat dispatcher's messages free and the hierarchical one's not)."""
    ep_overlap: float = field(default=0.0, metadata=_in(0, 1))
    """Fraction of EP time hidden behind compute (two-micro-batch overlap, DeepSeek-V3 sec. 3.2.2)."""
    weight_bytes: float = field(default=2.0, metadata=_gt(0, note=" bytes per element"))
    """Rollout weights and KV cache bytes per element (2 bf16, 1 FP8)."""
    dispatch_bytes: float = field(default=2.0, metadata=_gt(0, note=" bytes per element"))
    """Bytes per hidden element on the EP wire (moerl sends x's dtype; DeepEP can dispatch FP8)."""
    prompts_per_step: int = field(default=256, metadata=_ge(1))
    """Prompts per training step (each sampled ``group_size`` times)."""
    group_size: int = field(default=16, metadata=_ge(1))
    """Responses per prompt (a GRPO group); episodes per step = prompts_per_step x group_size."""
    prompt_len: float = field(default=1024, metadata=_ge(1, note=" tokens"))
    """P: mean prompt tokens (every prompt has at least one)."""
    response_len: float = field(default=4096, metadata=_ge(1, note=" tokens"))
    """E[r]: mean response tokens (every response has at least one)."""
    response_cv: float = field(default=0.5, metadata=_ge(0))
    """Coefficient of variation of the response length (std / mean); 0 = all of length E[r]."""
    max_staleness: int = field(default=1, metadata=_ge(0, note=" policy versions"))
    """Policy versions a sample may lag the trainer; 0 = on-policy (async runs as sync)."""
    mode: str = "async"
    """``async`` (rollout and training overlap) or ``sync`` (generate, then train)."""
    spot_rollout: bool = False
    """True: rollout nodes are Spot instances (price and interruptions of the catalog or the plan)."""
    notice_s: float = field(default=120.0, metadata=_ge(0, note=" s"))
    """Interruption notice, seconds: sequences that finish within it are not lost (0 = no notice)."""
    replace_s: float = field(default=600.0, metadata=_ge(0, note=" s"))
    """Seconds an interrupted replica is down (new instance, weights reloaded)."""
    hard_loss_fraction: float = field(default=0.0, metadata=_in(0, 1))
    """Fraction of Spot interruptions that come without a usable notice (a reclaim that beats its notice,
    a node off the network, a crash): the replica's in-flight work is lost but for its progress snapshots."""
    snapshot_tokens: float = field(default=0.0, metadata=_ge(0, note=" tokens (0: no snapshots)"))
    """``fleet.snapshot_tokens``: tokens per sequence between progress snapshots at the exchange; a hard
    loss costs at most that much per sequence (0: its whole progress)."""
    keep_partial: bool = False
    """``fleet.keep_partial``: a noticed interruption hands every generated prefix on (nothing lost); False:
    sequences that cannot finish within ``notice_s`` are lost."""
    sync_overlap: float = field(default=0.0, metadata=_in(0, 1))
    """Fraction of the weight sync hidden behind generation."""
    schedule: str = "auto"
    """How rollout and training share time (``moerl.plan.schedules``): ``colocated`` (every GPU generates,
    then every GPU trains), ``sync`` (rollout and training nodes take turns), ``one_step_off`` (batch n + 1
    is generated while batch n trains), ``fully_async`` (streaming with partial rollouts, bounded by
    ``max_staleness``); ``auto`` = ``fully_async`` when ``mode`` is async and ``max_staleness`` >= 1, else
    ``sync``."""
    weight_transport: str = "sharded_p2p"
    """How a policy version reaches the rollout GPUs (``moerl.plan.transports.TRANSPORTS``):
    ``nccl_broadcast``, ``sharded_p2p``, ``nccl_reshard``, ``checkpoint_engine``, ``object_store``,
    ``cuda_ipc`` (colocated only)."""
    sync_bucket_mb: float = field(default=256.0, metadata=_gt(0, note=" MiB"))
    """Bucket size of a weight sync, MiB (moerl's ``runtime.publish_bucket_mb`` default)."""
    sync_pipelined: bool = True
    """True: a sync's stages (gather, send, apply) overlap across buckets; False: one after the other."""
    sync_changed_fraction: float = field(default=1.0, metadata=_in(0, 1, lo_open=True))
    """Fraction of the elements a delta sync sends (each with a 4-byte index); 1 = the whole version."""
    sync_fp8: bool = False
    """True: the trainer requantizes bf16 to FP8 (128 x 128 block scales) before sending."""
    rollout_tp: int = field(default=0, metadata=_ge(0, note=" GPUs (0: EP over rollout_ep_nodes nodes)"))
    """> 0: a rollout replica is this many GPUs of one node, tensor parallel (vLLM-style); 0 = an EP group
    over ``rollout_ep_nodes`` whole nodes."""
    max_response_len: float = field(default=0.0, metadata=_ge(0, note=" tokens (0: no limit)"))
    """Response length limit; the tail of a synchronous batch ends at the expected longest of its responses,
    at most this (0: no limit)."""
    logprob_passes: int = field(default=0, metadata=_ge(0))
    """Forward passes over the batch on the trainer besides training (old-policy log-probs, reference)."""
    checkpoint_every: int = field(default=50, metadata=_ge(1, note=" steps"))
    """Training steps between checkpoints."""
    checkpoint_bytes_per_param: float = field(default=6.0, metadata=_gt(0))
    """Checkpoint bytes per parameter (6: bf16 weights + fp32 master copy)."""
    storage_gb_s_per_node: float = field(default=5.0, metadata=_gt(0, note=" GB/s"))
    """Checkpoint write bandwidth per training node."""
    steps_to_converge: int = field(default=1000, metadata=_ge(1, note=" steps"))
    """Training steps to a converged policy (prices ``usd_per_converged_policy``)."""
    price_on_demand: float = field(default=0.0, metadata=_ge(0, note=" $/node-hour (0: the catalog's)"))
    """USD per node-hour; 0 = the hardware catalog's price."""
    interruptions_per_hour: float = field(
        default=-1.0, metadata={"range": Range(note=" (< 0: the catalog's rate)")}
    )
    """Spot interruptions per node-hour; < 0 = the catalog's rate."""

    def __post_init__(self) -> None:
        self._check_names()
        check_ranges(self, GIVEN_RANGES)
        if self.auto_split and not self.train_share:  # a valid starting split; run() searches the rest
            object.__setattr__(self, "train_share", 1 / 3)
        if self.train_share > 0:  # at least the nodes that hold the training state (12 B per parameter)
            hw, m = get_hardware(self.hardware), get_model(self.model)
            need = ceil(m.num_params * 12 / (0.9 * hw.hbm_gb * 1e9 * hw.gpus_per_node))
            train = max(need, round(self.total_nodes * self.train_share))
            rollout = (self.total_nodes - train) // self.rollout_ep_nodes * self.rollout_ep_nodes
            object.__setattr__(self, "train_nodes", self.total_nodes - max(rollout, self.rollout_ep_nodes))
        check_ranges(self, SPLIT_RANGES)
        if (self.total_nodes - self.train_nodes) % self.rollout_ep_nodes:
            raise ConfigError(
                f"rollout nodes ({self.total_nodes - self.train_nodes}) must be a multiple of rollout_ep_nodes={self.rollout_ep_nodes}"
            )
        self._check_routing()
        self._check_spot()

    def _check_names(self) -> None:
        get_hardware(self.hardware), get_model(self.model)  # noqa: B018 - raise on unknown names
        if self.placement not in ("grouped", "round_robin"):
            raise ConfigError(f"placement must be grouped or round_robin, got {self.placement!r}")
        if self.ep_impl not in ("kernel", "moerl"):
            raise ConfigError(f"ep_impl must be kernel or moerl, got {self.ep_impl!r}")
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"mode must be async or sync, got {self.mode!r}")
        if self.schedule not in ("auto", *SCHEDULES):
            raise ConfigError(f"schedule must be one of auto, {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.weight_transport not in TRANSPORTS:
            raise ConfigError(
                f"weight_transport must be one of {', '.join(TRANSPORTS)}, got {self.weight_transport!r}"
            )
        if self.weight_transport in LOCAL_TRANSPORTS and self.schedule != "colocated":
            raise ConfigError(
                f"weight_transport={self.weight_transport} moves weights within a GPU: it needs schedule=colocated"
            )
        if self.rollout_tp > get_hardware(self.hardware).gpus_per_node:
            raise ConfigError(
                f"rollout_tp={self.rollout_tp} exceeds the {get_hardware(self.hardware).gpus_per_node} GPUs of a "
                f"{self.hardware} node"
            )

    def _check_routing(self) -> None:
        """Group-limited routing needs Gr | E and k <= M E / Gr (``traffic.miss_probability``)."""
        if self.router_groups == 1:  # unrestricted top-k: topk_groups is 1 by its range
            return
        m = get_model(self.model)
        if m.num_experts % self.router_groups:
            raise ConfigError(
                f"router_groups={self.router_groups} must divide the {m.num_experts} routed experts of {m.name}"
            )
        pool, k = self.topk_groups * m.num_experts // self.router_groups, self.top_k or m.top_k
        if k > pool:
            raise ConfigError(
                f"top_k={k} exceeds the {pool} experts of the topk_groups={self.topk_groups} of "
                f"router_groups={self.router_groups} groups a token keeps"
            )

    def _check_spot(self) -> None:
        """Spot availability 1 - n lambda (lost + replace_s) (``predict`` module docstring) is a first-order
        model: it needs n lambda replace_s < 1, i.e. a replica of n nodes interrupted less often than once
        per ``replace_s``."""
        if not self.spot_rollout:
            return
        rate = self.interruptions_per_hour
        rate = rate if rate >= 0 else get_hardware(self.hardware).interruptions_per_hour
        down = rate / 3600 * self.rollout_ep_nodes * self.replace_s
        if down >= 1:
            raise ConfigError(
                f"Spot: interruptions_per_hour={rate:g} x rollout_ep_nodes={self.rollout_ep_nodes} x "
                f"replace_s={self.replace_s:g} / 3600 = {down:.2f} must be < 1 (a replica would be down longer "
                "than it runs); lower interruptions_per_hour or replace_s"
            )

    @property
    def rollout_nodes(self) -> int:
        """total_nodes - train_nodes."""
        return self.total_nodes - self.train_nodes

    @property
    def schedule_used(self) -> str:
        """``schedule`` with ``auto`` resolved (its docstring)."""
        if self.schedule != "auto":
            return self.schedule
        return "fully_async" if self.mode == "async" and self.max_staleness >= 1 else "sync"


RANGES: dict[str, Range] = {f.name: f.metadata["range"] for f in fields(Plan) if "range" in f.metadata}
"""Field name -> valid range, for every int and float field of ``Plan``."""
SPLIT_RANGES = ("train_nodes", "train_ep_nodes")
"""Fields whose range depends on the split, checked after ``train_share`` has set train_nodes."""
GIVEN_RANGES = tuple(name for name in RANGES if name not in SPLIT_RANGES)


def check_ranges(plan: Plan, names: Iterable[str]) -> None:
    """Raise ConfigError for the first of ``names`` whose value is not finite or out of its ``Range``:
    ``"{name} must be {range}{note}, got {value}"``."""
    for name in names:
        value, rng = getattr(plan, name), RANGES[name]
        if isinstance(value, float) and not isfinite(value):  # inf or nan would print as a figure
            raise ConfigError(f"{name}={value} is not a finite number")
        if not rng.contains(value, plan):
            note = rng.note.format(model=get_model(plan.model))
            raise ConfigError(f"{name} must be {rng.describe(plan)}{note}, got {value}")


def parse_param(name: str, value: object) -> object:
    """``value`` (a string from the command line, or a YAML value) as the type of Plan field ``name``.

    Raises:
        ConfigError: unknown field (naming the fields) or a value of the wrong type.
    """
    names = [f.name for f in fields(Plan)]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"parameters: {', '.join(names)}"
        raise ConfigError(f"unknown plan parameter {name!r}; {hint}")
    kind = type(getattr(Plan(), name))
    text = str(value)  # YAML values too: 2.5 for an int field is an error, not a silent float
    try:
        return (
            {"True": True, "true": True, "False": False, "false": False}[text] if kind is bool else kind(text)
        )
    except (ValueError, KeyError):
        raise ConfigError(f"{name}: {text!r} is not a valid {kind.__name__}") from None


def with_params(plan: Plan, values: dict[str, object]) -> Plan:
    """A copy of ``plan`` with all ``values`` applied at once (validated together, so that e.g. total_nodes
    and train_nodes can change in one step). Raises ConfigError as ``parse_param`` and ``Plan``."""
    return replace(plan, **{k: parse_param(k, v) for k, v in values.items()})


def set_param(plan: Plan, name: str, value: object) -> Plan:
    """``with_params`` for one field."""
    return with_params(plan, {name: value})
