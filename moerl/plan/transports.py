"""Weight-sync transports as planner terms: seconds to move one policy version from the trainer to every
rollout GPU, from first principles, the hardware catalog and moerl's own weight-sync measurements.

Shapes of one sync (``SyncSetup``): N parameters held by S trainer GPUs; R rollout GPUs in replicas of g
GPUs (each GPU keeps 1/g of the weights: TP or EP shard); n = R / g replicas; e bytes per element on the
wire (2 bf16; 1 + 4/128^2 for FP8 with one fp32 scale per 128 x 128 block, DeepSeek-V3's release format);
a delta sync sends a fraction f of the elements with a 4-byte index each: wire bytes
W = N e min(1, f (1 + 4 / e)). Links per GPU: NIC b_net (catalog, times ``net_fraction``), NVLink b_nvl,
device copy b_copy and bucket cost c_b, pinned host copy b_pin (moerl's measurements, ``SyncConstants``).

Transports (``TRANSPORTS``; every one adds the sender's preparation, FP8 requantization and/or the delta
comparison: read 2 B + write e B (delta: read two versions, 4 B) per element, over the S trainer GPUs at
b_copy, and the receivers' apply: W / g bytes copied into the engine at b_copy):
- ``nccl_broadcast``: trainer rank 0 gathers each bucket from the other trainer ranks (NVLink inside its
  node, its NIC from other nodes) and broadcasts it to all R GPUs. NCCL's broadcast is a pipelined chain,
  so its time is the bytes over the slowest link of the chain, whatever R (Patarasuk and Yuan 2009, J.
  Parallel Distrib. Comput. 69(2), pipelined broadcast: T = W / b + (R - 1) chunk latencies). NeMo-RL's
  ``packed_broadcast_producer(src=0)`` and verl's checkpoint engine (``nccl`` backend: all_gather +
  broadcast) work this way. Stages per bucket: gather, broadcast, apply; ``sync_pipelined`` overlaps them
  across buckets (time = the slowest stage's total + the others' per-bucket time once), else they add up.
- ``sharded_p2p``: every trainer GPU writes its shard straight to the rollout GPUs that hold it
  (one-sided RDMA, Mooncake-style transfer engines; each replica is written by the trainers, so a sender
  carries its shard once per replica): the busiest NIC
  carries max(W / g received, W n / S sent); one message per (sender, receiver) pair that share bytes.
- ``nccl_reshard``: NeMo-RL's NCCL reshard refit (``docs/design-docs/nccl-reshard-refit.md``): the FFN
  projection weights (a fraction F of the bytes: routed experts and dense FFNs; shared experts excluded) are
  resharded shard to shard, each destination region moved once from the trainers, striped over the n
  replicas, then fanned out to the other replicas by broadcast; afterwards everything else (attention,
  embeddings, router, shared experts: 1 - F) is gathered on trainer rank 0 and broadcast to every rollout
  GPU in packed buffers (``nccl_broadcast``, pipelined over its two alternating buffers). Bulk, one stage
  after the other (the python reshard's order: point-to-point, then fan-out): the busiest NIC of the
  striped point-to-point, max(rounds F W / S sent, F W / (g n) received), then the fan-out, a pipelined chain
  over the n replicas carrying F W / g through each receiver's NIC (Patarasuk and Yuan 2009, as the
  broadcast above; nothing when n = 1); the misc broadcast follows the bulk (``megatron_policy_worker``
  ``nccl_reshard_refit``: bulk, ``torch.cuda.synchronize()``, then ``_broadcast_misc_params_packed``).
  A trainer of P pipeline stages has one reshard group per stage, and the rollout side takes the stages
  ``RESHARD_STREAMS`` at a time (``NRL_REFIT_NUM_STREAMS``, default 2): a stage's S / P GPUs send while its
  turn lasts, so the senders' term takes rounds = ceil(P / min(P, streams)) turns of F W / S each.
- ``checkpoint_engine``: the staged path of MoonshotAI's checkpoint-engine: every trainer GPU copies its
  shard to pinned host memory (W / S at b_pin), the buckets are broadcast between nodes from there (as
  ``nccl_broadcast``), each receiver copies its W / g to the device (b_pin); pipelined over buckets when
  ``sync_pipelined``.
- ``object_store``: the version is written to storage by the training nodes and read by every rollout node
  (moerl's ``store`` / ``object_store`` transports): W / (trainer nodes x storage GB/s) + W_node / storage
  GB/s, plus hashing at moerl's measured xxh3 rate on both sides.
- ``cuda_ipc``: colocated only: each GPU maps the trainer's buckets on the same device (moerl's
  ``cuda_ipc``): W / g at b_copy plus c_b per bucket.

Every bucket also pays c_b (moerl's per-bucket handshake: version check, event, table).

Per-tensor work (``SyncSetup.num_tensors`` T, counted from the model's shapes by ``predict.checkpoint_tensors``):
a sharded trainer (S > 1) that sends full tensors gathers them one at a time, and each gather costs the
host t_g whatever its bytes (``DTensor.full_tensor()`` dispatch, the collective's call, the loop: moerl's
``iter_full_tensors``, measured by ``bench/tensor_gather.py``). The host issues the gathers while the GPU
runs the earlier ones, so the gather stage takes max(bytes over the links, T t_g). It applies where the
sender gathers: ``nccl_broadcast`` (verl's checkpoint engine: ``engine.get_per_tensor_param()`` yields
``full_tensor()`` of each FSDP parameter, ``nccl_checkpoint_engine.send_weights`` casts and copies each
into the bucket), the misc part of ``nccl_reshard`` (its tensors only), ``object_store`` (moerl's
``stream_sharded``) and ``cuda_ipc`` from a sharded colocated trainer; not ``sharded_p2p`` or
``checkpoint_engine``, which send shards as they lie. Every receiver loads its tensors one at a time:
``receiver_tensors`` x t_a on top of the apply copy, t_a = moerl's engine copy per tensor above the flat
device copy (the weight-sync bench). Units: seconds, bytes, GB/s = 1e9 B/s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from math import ceil
from pathlib import Path

from moerl.configlib import ConfigError

RESHARD_STREAMS = 2
"""Pipeline stages NeMo-RL's reshard refit moves at once: the rollout side's CUDA streams
(``NRL_REFIT_NUM_STREAMS``, default 2; NeMo-RL ``docs/design-docs/nccl-reshard-refit.md`` "Operational knobs")."""
FP8_BYTES = 1 + 4 / (128 * 128)
"""Wire bytes per element of FP8 weights with one fp32 scale per 128 x 128 block (DeepSeek-V3 format)."""
INDEX_BYTES = 4
"""Bytes of the int32 position sent with each changed element of a delta sync."""
H200_HBM_TB_S = 4.8
"""HBM bandwidth of the GPU moerl's weight-sync bench ran on (NVIDIA H200 datasheet)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConstants:
    """moerl's own weight-sync measurements (``bench/results/weight_sync_reference_cuda.json``: the reference
    model, 13.8 GB in 49 buckets of 256 MiB, one H200), derived by ``sync_constants``; none is fitted."""

    copy_hbm_fraction: float
    """Device-to-device copy rate / HBM bandwidth (the bench's ``device_copy`` floor)."""
    bucket_s: float
    """Fixed cost per bucket: (cuda_ipc median - device copy floor - engine copy) / buckets, s."""
    pinned_gb_s: float
    """Device <-> pinned host copy rate (the bench's ``pinned_host_copy`` floor), GB/s per GPU."""
    store_gb_s: float
    """End-to-end rate of moerl's store path (write, xxh3, read, load) on one node, GB/s."""
    hash_gb_s: float
    """xxh3 of bytes on the host (the bench's ``xxh3_host`` floor), GB/s."""
    apply_tensor_s: float
    """t_a: the engine's copy of a version per tensor above the flat device copy, s per tensor: (engine copy
    - device copy floor) / tensors of the weight-sync bench."""
    tensor_s: float
    """t_g: host seconds per tensor of gathering a sharded tensor whole (moerl's ``iter_full_tensors``,
    CPU seconds on a 1-rank mesh: ``bench/tensor_gather.py``, ``TENSOR_FILE``)."""


def sync_constants(bench: dict, gather: dict) -> SyncConstants:
    """``SyncConstants`` from a ``bench/weight_sync.py --spec reference`` result on CUDA and a
    ``bench/tensor_gather.py`` result (module docstring).

    Raises:
        ConfigError: a result lacks the cuda_ipc or store rows, the floors, or the 1-rank gather row.
    """
    try:
        w, res, floors = bench["weight_bytes"], bench["results"], bench["floors_s"]
        ipc = res["cuda_ipc"]
        dev = floors["device_copy (CUDA IPC floor)"]
        return SyncConstants(
            copy_hbm_fraction=w / dev / (H200_HBM_TB_S * 1e12),
            bucket_s=(ipc["median_s"] - dev - ipc["engine_copy_s"]) / ipc["num_buckets"],
            pinned_gb_s=w / floors["pinned_host_copy"] / 1e9,
            store_gb_s=w / res["store"]["median_s"] / 1e9,
            hash_gb_s=w / floors["xxh3_host"] / 1e9,
            apply_tensor_s=max(0.0, ipc["engine_copy_s"] - dev) / bench["num_tensors"],
            tensor_s=gather["results"]["world_1"]["iter_full_tensors"]["cpu_s_per_tensor"],
        )
    except KeyError as e:
        raise ConfigError(
            f"weight-sync or tensor-gather bench result lacks {e}; run bench/weight_sync.py --spec reference "
            "and bench/tensor_gather.py"
        ) from None


def constants_of(cal: dict) -> SyncConstants:
    """The ``weight_sync`` record of a calibration (written by ``python -m moerl.plan.transports``).

    Raises:
        ConfigError: the calibration has no ``weight_sync`` record.
    """
    rec = cal.get("weight_sync")
    if not rec:
        raise ConfigError(
            "the calibration has no weight_sync record (python -m moerl.plan.transports writes it)"
        )
    return SyncConstants(**rec["constants"])


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncSetup:
    """One weight sync: what moves, from how many GPUs to how many, over which links (module docstring)."""

    num_params: float
    """N: parameters of the policy."""
    wire_bytes: float
    """e: bytes per element on the wire (2 bf16, ``FP8_BYTES``)."""
    changed_fraction: float = 1.0
    """f: fraction of elements a delta sync sends (1 = the whole version)."""
    is_fp8_requant: bool = False
    """True: the sender quantizes bf16 to FP8 before sending."""
    trainer_gpus: int
    rollout_gpus: int
    replica_gpus: int
    """g: GPUs of one rollout replica; each holds 1/g of the weights."""
    gpus_per_node: int
    net_gb_s: float
    """Achieved NIC bandwidth per GPU and direction (catalog x net_fraction), GB/s."""
    nvlink_gb_s: float
    """Achieved NVLink bandwidth per GPU and direction, GB/s."""
    copy_gb_s: float
    """Device copy rate (HBM x ``copy_hbm_fraction``), GB/s."""
    storage_gb_s: float
    """Storage bandwidth per node, GB/s (``object_store``)."""
    message_s: float
    """Cost of one inter-node message, s."""
    bucket_bytes: float
    is_pipelined: bool = True
    consts: SyncConstants
    bulk_fraction: float = 1.0
    """F: fraction of the weights in FFN projections (routed experts, dense FFNs), the part ``nccl_reshard``
    reshards shard to shard; the rest is broadcast from trainer rank 0. 1 = every byte is FFN."""
    pp_stages: int = 1
    """P: pipeline stages of the trainer; ``nccl_reshard`` moves ``RESHARD_STREAMS`` stages at a time."""
    num_tensors: int = 0
    """T: tensors of one version as the sender gathers them (0: no per-tensor cost counted)."""
    bulk_tensors: int = 0
    """Of the T tensors, those in FFN projections (``nccl_reshard``'s bulk path; the rest ride its misc path)."""
    receiver_tensors: int = 0
    """Tensors one rollout GPU loads (all T for a TP replica; the non-expert ones and its experts' for EP)."""

    @property
    def bytes_on_wire(self) -> float:
        """W = N e min(1, f (1 + 4 / e)): bytes of one version on the wire."""
        return (
            self.num_params
            * self.wire_bytes
            * min(1.0, self.changed_fraction * (1 + INDEX_BYTES / self.wire_bytes))
        )

    @property
    def num_buckets(self) -> int:
        """Buckets of the sender's stream (at least one)."""
        return max(1, ceil(self.bytes_on_wire / self.bucket_bytes))


@dataclass(frozen=True, slots=True)
class SyncTime:
    """Seconds of one sync by part; ``total_s`` is what the rollout waits (and the trainer sends)."""

    transport: str
    prepare_s: float
    transfer_s: float
    apply_s: float
    buckets_s: float

    @property
    def total_s(self) -> float:
        """prepare + transfer + apply + per-bucket costs."""
        return self.prepare_s + self.transfer_s + self.apply_s + self.buckets_s


def _prepare_s(s: SyncSetup) -> float:
    """Sender-side passes over its 1/S of the weights: FP8 requantization (read 2 B, write e B) and the delta
    comparison (read the new and the last sent version, 4 B)."""
    per_elem = (2 + s.wire_bytes if s.is_fp8_requant else 0.0) + (4.0 if s.changed_fraction < 1 else 0.0)
    return s.num_params / s.trainer_gpus * per_elem / (s.copy_gb_s * 1e9)


def _apply_s(s: SyncSetup) -> float:
    """A receiver copies its W / g bytes into the engine's parameters, one tensor at a time (t_a each)."""
    return (
        s.bytes_on_wire / s.replica_gpus / (s.copy_gb_s * 1e9) + s.receiver_tensors * s.consts.apply_tensor_s
    )


def _gather_host_s(s: SyncSetup) -> float:
    """T t_g: the host's per-tensor work of gathering a sharded trainer's tensors whole (0 for S = 1)."""
    return s.num_tensors * s.consts.tensor_s if s.trainer_gpus > 1 else 0.0


def _stages(stage_totals: list[float], buckets: int, pipelined: bool) -> float:
    """Stages over ``buckets`` buckets: pipelined, the slowest stage's total plus one bucket of each other
    stage (fill and drain); else the sum."""
    if not pipelined:
        return sum(stage_totals)
    slow = max(stage_totals)
    return slow + (sum(stage_totals) - slow) / buckets


def nccl_broadcast(s: SyncSetup) -> SyncTime:
    """Gather on trainer rank 0, pipelined broadcast to every rollout GPU (module docstring)."""
    w = s.bytes_on_wire
    local = min(s.trainer_gpus, s.gpus_per_node)
    gather = w * (local - 1) / s.trainer_gpus / (s.nvlink_gb_s * 1e9)
    gather += w * (s.trainer_gpus - local) / s.trainer_gpus / (s.net_gb_s * 1e9)
    gather = max(gather, _gather_host_s(s))  # the host issues tensor k + 1 while the GPU gathers k
    bcast = w / (s.net_gb_s * 1e9) + s.rollout_gpus * s.message_s  # chain of R hops: one latency each
    apply = _apply_s(s)
    moved = _stages([gather, bcast, apply], s.num_buckets, s.is_pipelined)
    return SyncTime("nccl_broadcast", _prepare_s(s), moved - apply, apply, s.num_buckets * s.consts.bucket_s)


def sharded_p2p(s: SyncSetup) -> SyncTime:
    """Every trainer GPU writes its shard to the rollout GPUs holding it; the busiest NIC sets the time."""
    w = s.bytes_on_wire
    replicas = s.rollout_gpus / s.replica_gpus
    busiest = max(w / s.replica_gpus, w * replicas / s.trainer_gpus)
    pairs = max(s.trainer_gpus / s.replica_gpus, 1.0)  # senders whose bytes one receiver takes
    wire = busiest / (s.net_gb_s * 1e9) + pairs * s.message_s
    buckets = max(1, ceil(w / s.trainer_gpus / s.bucket_bytes))  # each sender streams its own shard
    return SyncTime("sharded_p2p", _prepare_s(s), wire, _apply_s(s), buckets * s.consts.bucket_s)


def nccl_reshard(s: SyncSetup) -> SyncTime:
    """FFN weights resharded shard to shard (striped point-to-point, then fan-out to the replicas), then the
    rest broadcast from trainer rank 0 (module docstring)."""
    w = s.bytes_on_wire
    bulk, replicas = w * s.bulk_fraction, max(1.0, s.rollout_gpus / s.replica_gpus)
    rounds = ceil(s.pp_stages / min(s.pp_stages, RESHARD_STREAMS))  # turns of the stages' senders
    striped = max(rounds * bulk / s.trainer_gpus, bulk / (s.replica_gpus * replicas)) / (s.net_gb_s * 1e9)
    fan_out = 0.0 if replicas <= 1 else bulk / s.replica_gpus / (s.net_gb_s * 1e9) + replicas * s.message_s
    pairs = max(s.trainer_gpus / s.replica_gpus, 1.0)  # senders whose regions one receiver takes
    misc_s = 0.0
    if s.bulk_fraction < 1:  # packed buffers of bucket_bytes; two alternate (packed_tensor.py), so pipelined
        misc = replace(s, num_params=s.num_params * (1 - s.bulk_fraction), is_pipelined=True,
                       num_tensors=s.num_tensors - s.bulk_tensors)  # fmt: skip
        t = nccl_broadcast(misc)
        misc_s = t.transfer_s + t.buckets_s  # its preparation and apply are counted once, over all of W
    buckets = max(1, ceil(bulk / s.trainer_gpus / s.bucket_bytes))  # each sender streams its own regions
    wire = striped + pairs * s.message_s + fan_out + misc_s
    return SyncTime("nccl_reshard", _prepare_s(s), wire, _apply_s(s), buckets * s.consts.bucket_s)


def checkpoint_engine(s: SyncSetup) -> SyncTime:
    """Device -> pinned host -> network broadcast -> pinned host -> device, per bucket (module docstring)."""
    w = s.bytes_on_wire
    d2h = w / s.trainer_gpus / (s.consts.pinned_gb_s * 1e9)  # each trainer GPU stages its shard
    bcast = w / (s.net_gb_s * 1e9) + s.rollout_gpus / s.gpus_per_node * s.message_s
    h2d = w / s.replica_gpus / (s.consts.pinned_gb_s * 1e9)
    apply = _apply_s(s)
    moved = _stages([d2h, bcast, h2d, apply], s.num_buckets, s.is_pipelined)
    return SyncTime(
        "checkpoint_engine", _prepare_s(s), moved - apply, apply, s.num_buckets * s.consts.bucket_s
    )


def object_store(s: SyncSetup) -> SyncTime:
    """Training nodes write the version, every rollout node reads its replicas' shards; xxh3 both ways."""
    w = s.bytes_on_wire
    train_nodes = max(1, s.trainer_gpus // s.gpus_per_node)
    per_node = w * min(s.gpus_per_node, s.rollout_gpus) / s.replica_gpus  # its GPUs' shards: W / g each
    write = w / train_nodes / (s.storage_gb_s * 1e9) + w / train_nodes / (s.consts.hash_gb_s * 1e9)
    write += _gather_host_s(s)  # stream_sharded gathers tensor by tensor before it packs
    read = per_node / (s.storage_gb_s * 1e9) + per_node / (s.consts.hash_gb_s * 1e9)
    return SyncTime("object_store", _prepare_s(s), write + read, _apply_s(s), 0.0)


def cuda_ipc(s: SyncSetup) -> SyncTime:
    """Colocated: a sharded trainer gathers each tensor whole, and the rollout engine copies its shard from
    the trainer's buckets on the same GPU."""
    w = s.bytes_on_wire / s.replica_gpus
    buckets = max(1, ceil(w / s.bucket_bytes))
    apply = _apply_s(s)
    return SyncTime("cuda_ipc", _prepare_s(s), _gather_host_s(s), apply, buckets * s.consts.bucket_s)


TRANSPORTS = {f.__name__: f for f in (nccl_broadcast, sharded_p2p, nccl_reshard, checkpoint_engine, object_store,
                                        cuda_ipc)}  # fmt: skip
"""Transport name -> its time model (``Plan.weight_transport``)."""
LOCAL_TRANSPORTS = ("cuda_ipc",)
"""Transports that move weights within a GPU: only the colocated schedule can use them."""


def sync_time(setup: SyncSetup, transport: str) -> SyncTime:
    """Seconds of one sync over ``transport``. Raises ConfigError naming the transports for an unknown one."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown weight_transport {transport!r}; transports: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[transport](setup)


BENCH_FILE = "weight_sync_reference_cuda.json"
"""The bench result the constants come from (``bench/results``)."""
TENSOR_FILE = "issue53/tensor_gather_cpu.json"
"""The per-tensor gather measurement ``tensor_s`` comes from (``bench/results``; ``bench/tensor_gather.py``)."""


def write_record(results: Path, calibration: Path) -> dict:
    """Derive ``SyncConstants`` from ``results/BENCH_FILE`` and ``results/TENSOR_FILE`` and store them (with
    their sources and the bench dates) as ``weight_sync`` in ``calibration``; the frozen keys are untouched
    (``freeze.FITTED_KEYS``).

    Raises:
        FileNotFoundError: a bench file is missing. ConfigError: it lacks a field.
    """
    bench = json.loads((results / BENCH_FILE).read_text())
    gather = json.loads((results / TENSOR_FILE).read_text())
    consts = sync_constants(bench, gather)
    cal = json.loads(calibration.read_text())
    cal["weight_sync"] = {
        "constants": {k: getattr(consts, k) for k in SyncConstants.__slots__},
        "source": f"bench/results/{BENCH_FILE} ({bench['device']['device']}, {bench['device']['date']}); "
        f"tensor_s: bench/results/{TENSOR_FILE} ({gather['device']['device']}, {gather['device']['date']}): "
        "derived, not fitted (moerl.plan.transports.sync_constants)",
    }
    calibration.write_text(json.dumps(cal, indent=2) + "\n")
    return cal["weight_sync"]


if __name__ == "__main__":  # python -m moerl.plan.transports
    from moerl.plan.args import CALIBRATION, RESULTS

    print(json.dumps(write_record(RESULTS, CALIBRATION), indent=2))
