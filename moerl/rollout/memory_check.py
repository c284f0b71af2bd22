"""Load-time memory estimate of a run: the rollout engines' KV caches plus the policy's weights on the
device the run builds them on, against what that device has free (``check_memory``, called by
``moerl.run.preflight.check_run_inputs`` before the warm start).

The engines preallocate their whole cache (``moerl.rollout.paged_kv_cache.PagedKVCache`` or
``moerl.rollout.kv_cache.SlotKVCache``), so engine sizes
too large for the machine are certain to fail, minutes later (an OOM kill after the warm start). The
estimate is a lower bound of what the device must hold: every engine's cache, sized by the same
functions the engine uses (``cache_geometry``, ``cache_bytes``), plus one copy of the weights per
process that holds the policy there. Activations, optimizer state and the CUDA context come on top;
``MEMORY_HEADROOM`` leaves room for them.

Which parts share the checked device (``model.device``, where the driver builds its engines):

    sft (``moerl sft``)          its model + the eval engine
    sync                         trainer + eval engine, the worker's copy of the policy + its engine
    async, local Ray, CPU        the driver's, and each of the ``rollout.num_workers`` workers'
                                 copy + one engine per EP rank (``rollout.ep_size``)
    async, local Ray, CUDA       the driver's, and at most one worker rank (Ray gives each a GPU of its own)
    async, ``runtime.ray_address``  the driver's only (the workers run on the cluster's nodes)

Where each part runs is the run's ``moerl.placement.Placement``: in async mode a rollout worker
evaluates (``driver.evaluates_later`` False) but version 0, which the driver evaluates on its own engine
while the workers start (``driver.evaluates_start``: not with a trainer group or FP8 rollout weights);
the driver holds the policy only as the one-process trainer's model (``driver.holds_policy``): none with
a trainer group.

A trainer group (``placement.trainer.is_group``) of local processes on the host adds one more copy (its
shards). Cluster runs are checked where ``moerl train`` runs, never by ``moerl cluster render``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moerl.configlib import ConfigError
from moerl.models.build import arch_from_model_config
from moerl.models.config import MoeConfig
from moerl.models.dtypes import torch_dtype
from moerl.models.model import MoeForCausalLM
from moerl.rollout.kv_cache import cache_bytes, cache_geometry, kv_layout
from moerl.rollout.paged_kv_cache import paged_geometry

if TYPE_CHECKING:  # the config and the placement sit above the rollout engine (docs/architecture.md, Layers)
    from moerl.config import RunConfig
    from moerl.placement import Placement

MEMORY_HEADROOM = 0.9
"""The estimate must fit in this share of the device's available memory (the rest: activations,
optimizer state, allocator slack)."""

GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What the engines and the policy copies of a run need on one device (bytes)."""

    device: str
    """``host`` or ``cuda:N``."""
    num_slots: int
    """N: slots of one engine's cache (``cache_geometry``); 1 for a paged cache."""
    slot_tokens: int
    """S: tokens per slot; a paged cache's tokens (its blocks and the null block)."""
    engine_bytes: int
    """One engine's cache: keys, values and (R3) routed experts."""
    num_engines: int
    """Engines built on the device."""
    weight_bytes: int
    """One copy of the policy's parameters in ``model.dtype``."""
    num_copies: int
    """Copies of the policy held on the device."""

    @property
    def total_bytes(self) -> int:
        """``num_engines * engine_bytes + num_copies * weight_bytes``."""
        return self.num_engines * self.engine_bytes + self.num_copies * self.weight_bytes


def policy_arch(cfg: RunConfig, vocab_size: int) -> MoeConfig | None:
    """The architecture of the run's policy: ``init_from``'s or ``model.path``'s config.json when the
    folder has one, else the fresh model of ``cfg.model`` with ``vocab_size`` tokens. None when the
    config.json cannot be read (the loader reports that folder with its own message)."""
    for folder in (cfg.init_from, cfg.model.path):
        if folder is not None and (Path(folder) / "config.json").is_file():
            try:
                return MoeConfig.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))
            except (OSError, ValueError, TypeError, KeyError):
                return None
    return arch_from_model_config(cfg.model, vocab_size)


def engine_cache_bytes(arch: MoeConfig, cfg: RunConfig, cache_kind: str) -> tuple[int, int, int]:
    """``(N, S, bytes)`` of one rollout engine of the run (``moerl.runtime.build.make_engine`` over
    ``arch``) whose cache is ``cache_kind`` (``Placement.rollout.cache_kind``). Slots: N slots of S
    tokens. Paged: N = 1 region of S = (blocks + the null block) x block size tokens (``PagedKVCache``)."""
    r = cfg.rollout
    routed = (len(arch.moe_layer_ids), arch.num_experts_per_tok) if r.return_routed_experts else None
    dtype = torch_dtype(cfg.model.dtype)
    if cache_kind == "paged":
        num_blocks, _ = paged_geometry(
            r.kv_token_budget, r.kv_block_size, arch.max_position_embeddings, r.max_slots
        )
        tokens = (num_blocks + 1) * r.kv_block_size
        return 1, tokens, cache_bytes(kv_layout(arch, r.mla_cache), 1, tokens, dtype, routed)
    num_slots, slot_tokens = cache_geometry(r.max_slots, r.kv_token_budget, arch.max_position_embeddings)
    return (
        num_slots,
        slot_tokens,
        cache_bytes(kv_layout(arch, r.mla_cache), num_slots, slot_tokens, dtype, routed),
    )


def weight_bytes(arch: MoeConfig, dtype: torch.dtype) -> int:
    """Bytes of the policy's parameters in ``dtype``, counted on a model built on the meta device (no
    memory allocated)."""
    with torch.device("meta"):
        model = MoeForCausalLM(arch)
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * elem


def ep_rank_weight_bytes(arch: MoeConfig, dtype: torch.dtype, ep_size: int) -> int:
    """Bytes of the policy's parameters one EP rank of ``ep_size`` holds in ``dtype``: every non-expert
    parameter (attention, router, embeddings, shared experts) and 1/``ep_size`` of the routed experts'
    (``moerl.ep.parallelize`` splits ``gate_up_proj`` and ``down_proj`` along the expert dimension)."""
    with torch.device("meta"):
        model = MoeForCausalLM(arch)
    elem = torch.empty((), dtype=dtype).element_size()
    total = sum(p.numel() for p in model.parameters())
    routed = sum(
        block.experts.gate_up_proj.numel() + block.experts.down_proj.numel() for block in model.moe_blocks()
    )
    return (total - routed + routed // ep_size) * elem


FP8_BLOCK = 128
"""Side of the square weight blocks sharing one float32 scale in the FP8 checkpoint format (DeepSeek-V3's
release: ``weight_scale_inv`` per 128 x 128 block)."""

_FP8_KEEP = ("embed_tokens.", "lm_head.", ".router.")
"""Parameters an FP8 checkpoint keeps in bf16 besides vectors (norms, biases): embeddings, LM head, router."""


WEIGHT_FORMAT_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""Short weight-format names (``rollout.weight_dtype``) of the ``model.dtype`` names."""


def rollout_weight_format(cfg: RunConfig, placement: Placement) -> str:
    """The rollout engines' weight format: ``placement.rollout.weight_dtype`` (``bf16`` / ``fp8``,
    ``moerl.rollout.weight_dtype``) unless it is ``auto``, else ``model.dtype``. The one place the memory
    checks read it."""
    fmt = placement.rollout.weight_dtype
    return cfg.model.dtype if fmt == "auto" else fmt


def _param_bytes(name: str, shape: torch.Size, weight_format: str, experts_kept: int | None) -> int:
    """Bytes of one parameter ``name`` of ``shape`` in ``weight_format``. Routed experts' [E, out, in]
    tensors count ``experts_kept`` of their E experts (None: all). ``fp8``: a matrix (and every expert's)
    takes 1 byte per element plus a float32 scale per ``FP8_BLOCK`` x ``FP8_BLOCK`` block; vectors and
    ``_FP8_KEEP`` parameters take 2 bytes (bf16)."""
    dims = list(shape)
    if experts_kept is not None:
        dims[0] = experts_kept
    numel = math.prod(dims)
    if weight_format != "fp8":
        dtype = torch_dtype(WEIGHT_FORMAT_DTYPES.get(weight_format, weight_format))
        return numel * torch.empty((), dtype=dtype).element_size()
    if len(dims) < 2 or any(k in f".{name}" for k in _FP8_KEEP):
        return numel * 2
    lead = math.prod(dims[:-2])
    blocks = lead * -(-dims[-2] // FP8_BLOCK) * -(-dims[-1] // FP8_BLOCK)
    return numel + 4 * blocks


def rollout_rank_weight_bytes(arch: MoeConfig, weight_format: str, ep_size: int) -> int:
    """Bytes of the policy one rollout EP rank of ``ep_size`` holds in ``weight_format`` (``bf16``,
    ``fp8``, or a ``model.dtype`` name): every non-expert parameter and 1/``ep_size`` of the routed
    experts (as ``ep_rank_weight_bytes``), FP8 matrices with their block scales (``_param_bytes``).

    Raises:
        ValueError: ``ep_size`` does not divide the routed experts.
    """
    if arch.num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {arch.num_experts} routed experts")
    with torch.device("meta"):
        model = MoeForCausalLM(arch)
    experts = {id(b.experts.gate_up_proj) for b in model.moe_blocks()} | {
        id(b.experts.down_proj) for b in model.moe_blocks()
    }
    local = arch.num_experts // ep_size
    return sum(
        _param_bytes(n, p.shape, weight_format, local if id(p) in experts else None)
        for n, p in model.named_parameters()
    )


def residents(placement: Placement, device: torch.device, *, rollouts: bool = True) -> tuple[int, int]:
    """``(engines, policy copies)`` the run placed as ``placement`` builds on ``device`` (the module
    docstring's table). ``rollouts=False``: ``moerl sft`` (its model and the eval engine only)."""
    engines, copies = 1, 1  # the driver's policy (trainer, eval) and its eval engine
    driver, rollout = placement.driver, placement.rollout
    if rollouts and not driver.evaluates_later:  # the driver's eval engine: the start eval's only
        engines, copies = int(driver.evaluates_start), int(driver.holds_policy)
    local_ray = placement.starts_local_ray
    if rollouts and rollout.is_in_driver:
        engines, copies = engines + 1, copies + 1
    elif rollouts and local_ray and device.type == "cuda":
        engines, copies = engines + 1, copies + 1
    elif rollouts and local_ray:
        workers = rollout.num_workers
        engines, copies = engines + workers * rollout.ep_size, copies + workers
    if device.type != "cuda" and placement.trainer.is_group and (rollout.is_in_driver or local_ray):
        copies += 1
    return engines, copies


def estimate_memory(
    cfg: RunConfig, placement: Placement, vocab_size: int, *, rollouts: bool = True
) -> MemoryEstimate | None:
    """The run's ``MemoryEstimate`` on ``model.device`` (``placement``: ``moerl.placement.Placement`` of
    ``cfg``); None when the policy's config cannot be read."""
    arch = policy_arch(cfg, vocab_size)
    if arch is None:
        return None
    device = torch.device(cfg.model.device)
    num_slots, slot_tokens, engine = engine_cache_bytes(arch, cfg, placement.rollout.cache_kind)
    engines, copies = residents(placement, device, rollouts=rollouts)
    name = "host" if device.type != "cuda" else f"cuda:{device.index or 0}"
    weights = weight_bytes(arch, torch_dtype(cfg.model.dtype))
    return MemoryEstimate(name, num_slots, slot_tokens, engine, engines, weights, copies)


def host_available_bytes() -> tuple[int, str]:
    """``(bytes, source)``: memory this process can still get on the host: ``MemAvailable`` of
    /proc/meminfo (else ``os.sysconf`` free pages), lowered to the cgroup v2 limit's remainder
    (``memory.max - memory.current``) inside a container that has one."""
    available, source = None, "MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available, source = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available, source
    if limit != "max" and int(limit) - used < available:
        return max(int(limit) - used, 0), "cgroup memory.max - memory.current"
    return available, source


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """``(bytes, source)`` free on ``device``: the host's (``host_available_bytes``) or a GPU's
    (``torch.cuda.mem_get_info``); None for a CUDA device this machine lacks (checked elsewhere)."""
    if device.type != "cuda":
        return host_available_bytes()
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free, f"torch.cuda.mem_get_info(cuda:{device.index or 0})"


def check_memory(
    cfg: RunConfig, placement: Placement, vocab_size: int, *, rollouts: bool = True
) -> MemoryEstimate | None:
    """Refuse a run whose engines' caches and policy copies cannot fit ``model.device``'s memory.

    Args:
        cfg: the run config.
        placement: where its parts run (``moerl.placement.Placement.from_config(cfg)``).
        vocab_size: the run tokenizer's vocabulary (a fresh policy's V).
        rollouts: count the rollout workers' engines (False for ``moerl sft``).
    Returns:
        The estimate (None when the policy's config.json cannot be read, or the device is absent).
    Raises:
        ConfigError: the estimate exceeds ``MEMORY_HEADROOM`` of the available memory; names
            ``rollout.max_slots`` and ``rollout.kv_token_budget``, the estimate and the available GiB.
    """
    est = estimate_memory(cfg, placement, vocab_size, rollouts=rollouts)
    device = torch.device(cfg.model.device)
    free = available_bytes(device) if est is not None else None
    if est is None or free is None:
        return est
    available, source = free
    if est.total_bytes <= MEMORY_HEADROOM * available:
        return est
    r = cfg.rollout
    paged = placement.rollout.cache_kind == "paged"
    layout = (
        f"{est.slot_tokens} tokens in blocks of {r.kv_block_size}"
        if paged
        else f"{est.num_slots} slots x {est.slot_tokens} tokens"
    )
    hint = (
        "lower rollout.max_slots or rollout.kv_token_budget"
        if est.num_engines * est.engine_bytes >= est.num_copies * est.weight_bytes
        else "use a smaller model (model.*), another model.device or fewer rollout.num_workers"
    )
    raise ConfigError(
        f"rollout.max_slots={r.max_slots}, rollout.kv_token_budget={r.kv_token_budget}: the run needs about "
        f"{est.total_bytes / GIB:.1f} GiB of {est.device} memory ({est.num_engines} rollout engine KV "
        f"cache(s) of {est.engine_bytes / GIB:.2f} GiB each, {layout}, "
        f"plus {est.num_copies} copies of the policy weights of {est.weight_bytes / GIB:.2f} GiB each), but "
        f"{available / GIB:.1f} GiB is available ({source}; at most {MEMORY_HEADROOM:.0%} of it is used); "
        f"{hint}"
    )
