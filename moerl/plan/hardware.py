"""Hardware catalog: AWS GPU instances with every figure's source.

Units: FLOP/s as TFLOP/s (1e12, dense, no sparsity), bandwidths in GB/s (1e9 B/s) per direction, memory
in GB (1e9 B), prices in USD per instance-hour, interruption rates per instance-hour.

Datasheet figures are peaks. What moerl reaches of them is not a datasheet figure: the fractions live in
``calibration.json`` (``moerl.plan.calibrate``), fitted on ``bench/results``. Prices change; they are
parameters (``moerl plan --set price_on_demand=...``), and the defaults say where they were read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from moerl.configlib import ConfigError

_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16 dense; 40 GB 1555 GB/s, 80 GB 2039 GB/s"
)
_H100 = "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 1979 FP8 dense, 80 GB HBM3 at 3.35 TB/s"
_H200 = "NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 1979 FP8 dense, 141 GB HBM3e at 4.8 TB/s"
_B200 = "NVIDIA B200 (HGX B200 datasheet): 2250 TFLOP/s bf16 dense, 4500 FP8 dense, 8 TB/s; AWS lists 179 GB per GPU"
_B300 = "NVIDIA Blackwell Ultra B300 (HGX B300 datasheet, approximate): bf16 as B200, FP8 4500 dense, 8 TB/s; AWS lists 268 GB per GPU"
_NVL3 = "NVLink 3: 600 GB/s bidirectional per GPU (A100 datasheet) = 300 GB/s per direction"
_NVL4 = "NVLink 4: 900 GB/s bidirectional per GPU (H100/H200 datasheet) = 450 GB/s per direction"
_NVL5 = "NVLink 5: 1.8 TB/s bidirectional per GPU (B200 datasheet) = 900 GB/s per direction"
_EFA = "AWS EC2 accelerated-computing instance specs (aws.amazon.com/ec2/instance-types/p4, /p5, /p6)"
_CB = (
    "EC2 Capacity Blocks pricing page (aws.amazon.com/ec2/capacityblocks/pricing, snapshot before 2025-01-01): "
    "effective instance hourly rate"
)
_MSG = (
    "assumption: per-message cost of a GPU-initiated RDMA write on EFA (SRD), of the order of the DeepEP "
    "low-latency kernels' EP8 dispatch (77 us for 8 peers, DeepEP README legacy table, H800 + CX7 IB)"
)
_SPOT = "assumption: Spot at 50% of the on-demand rate (GPU Spot discounts vary by region and day)"
_INT = "assumption: 1 interruption per 100 instance-hours (AWS Spot Advisor bins are per month; GPU families >20%)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One GPU instance type (a node). Raises ConfigError on non-positive figures."""

    name: str
    gpu: str
    gpus_per_node: int
    bf16_tflops: float
    """Dense bf16 matmul peak per GPU."""
    fp8_tflops: float
    """Dense FP8 matmul peak per GPU (bf16 figure where the GPU has no FP8)."""
    hbm_tb_s: float
    """HBM bandwidth per GPU, TB/s."""
    hbm_gb: float
    """HBM capacity per GPU."""
    nvlink_gb_s: float
    """NVLink bandwidth per GPU and direction."""
    net_gb_s: float
    """Inter-node (EFA) bandwidth per node and direction."""
    net_message_us: float = 10.0
    """Cost of one inter-node message (per peer and call), microseconds."""
    price_on_demand: float
    """USD per instance-hour."""
    spot_fraction: float = 0.5
    """Spot price as a fraction of ``price_on_demand``."""
    interruptions_per_hour: float = 0.01
    """Spot interruptions per instance-hour."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Field name -> where the figure comes from."""

    def __post_init__(self) -> None:
        for f in (
            "gpus_per_node",
            "bf16_tflops",
            "fp8_tflops",
            "hbm_tb_s",
            "hbm_gb",
            "nvlink_gb_s",
            "net_gb_s",
        ):
            if getattr(self, f) <= 0:
                raise ConfigError(f"hardware.{f} must be > 0, got {getattr(self, f)}")
        if self.price_on_demand < 0 or not 0 <= self.spot_fraction <= 1 or self.interruptions_per_hour < 0:
            raise ConfigError("hardware: price >= 0, spot_fraction in [0, 1], interruptions_per_hour >= 0")

    @property
    def net_gb_s_per_gpu(self) -> float:
        """EFA bandwidth per GPU and direction (the node's NICs shared evenly: rail-optimized)."""
        return self.net_gb_s / self.gpus_per_node

    @property
    def price_spot(self) -> float:
        """USD per Spot instance-hour."""
        return self.price_on_demand * self.spot_fraction

    def as_dict(self) -> dict:
        """Fields, sources included."""
        return asdict(self)


def _node(
    name: str, gpu: str, chip: str, nvl: str, gbps: float, price: float, price_src: str, **kw
) -> Hardware:
    src = {
        "bf16_tflops": chip, "fp8_tflops": chip, "hbm_tb_s": chip, "hbm_gb": chip, "nvlink_gb_s": nvl,
        "net_gb_s": f"{_EFA}: {gbps:g} Gbps EFA per instance", "gpus_per_node": _EFA,
        "net_message_us": _MSG, "price_on_demand": price_src, "spot_fraction": _SPOT,
        "interruptions_per_hour": _INT,
    }  # fmt: skip
    return Hardware(
        name=name, gpu=gpu, gpus_per_node=8, net_gb_s=gbps / 8, price_on_demand=price, sources=src, **kw
    )


_P4_PRICE = f"{_CB}: p4d.24xlarge $14.75 (US East Ohio)"
_P5_PRICE = f"{_CB}: p5.48xlarge $39.33 (US East N. Virginia)"
_P5E_PRICE = f"{_CB}: 8 x H200 instance $43.26 (US East Ohio)"
_P6_PRICE = "assumption: 2x the p5e/p5en capacity-block rate (no public rate found here); override with --set"

HARDWARE: dict[str, Hardware] = {
    "p4d": _node("p4d", "A100-40GB", _A100, _NVL3, 400, 14.75, _P4_PRICE, bf16_tflops=312, fp8_tflops=312,
                 hbm_tb_s=1.555, hbm_gb=40, nvlink_gb_s=300, net_message_us=15.0),
    "p4de": _node("p4de", "A100-80GB", _A100, _NVL3, 400, 14.75 * 1.25, f"assumption: p4d rate x 1.25 ({_P4_PRICE})",
                  bf16_tflops=312, fp8_tflops=312, hbm_tb_s=2.039, hbm_gb=80, nvlink_gb_s=300, net_message_us=15.0),
    "p5": _node("p5", "H100", _H100, _NVL4, 3200, 39.33, _P5_PRICE, bf16_tflops=989, fp8_tflops=1979,
                hbm_tb_s=3.35, hbm_gb=80, nvlink_gb_s=450),
    "p5e": _node("p5e", "H200", _H200, _NVL4, 3200, 43.26, _P5E_PRICE, bf16_tflops=989, fp8_tflops=1979,
                 hbm_tb_s=4.8, hbm_gb=141, nvlink_gb_s=450),
    "p5en": _node("p5en", "H200", _H200, _NVL4, 3200, 43.26, f"{_P5E_PRICE}; same GPUs as p5e",
                  bf16_tflops=989, fp8_tflops=1979, hbm_tb_s=4.8, hbm_gb=141, nvlink_gb_s=450, net_message_us=8.0),
    "p6-b200": _node("p6-b200", "B200", _B200, _NVL5, 3200, 86.52, _P6_PRICE, bf16_tflops=2250, fp8_tflops=4500,
                     hbm_tb_s=8.0, hbm_gb=179, nvlink_gb_s=900, net_message_us=8.0),
    "p6-b300": _node("p6-b300", "B300", _B300, _NVL5, 6400, 100.0, _P6_PRICE, bf16_tflops=2250, fp8_tflops=4500,
                     hbm_tb_s=8.0, hbm_gb=268, nvlink_gb_s=900, net_message_us=8.0),
}  # fmt: skip
"""The catalog. p5en differs from p5e by its EFAv3 NICs (lower latency; same 3200 Gbps): hence a lower
``net_message_us`` (an assumption, as every message cost here)."""


def get_hardware(name: str) -> Hardware:
    """The instance called ``name``. Raises ConfigError naming the catalog when it is unknown."""
    if name not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; catalog: {', '.join(HARDWARE)}")
    return HARDWARE[name]
