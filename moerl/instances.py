"""EC2 GPU instance families and their GPUs per instance, to check a cluster's GPU node groups.

Only families whose GPUs run bf16 (NVIDIA Ampere and newer) are listed. Source: the AWS EC2
accelerated-computing instance pages (aws.amazon.com/ec2/instance-types/p4, /p5, /p6, /g5, /g6, /g6e),
read 2026. A size not listed has an unknown GPU count: the group then has to say ``gpus_per_node``.
"""

from __future__ import annotations

GPU_FAMILIES: dict[str, str] = {
    "p4d": "A100 40 GB",
    "p4de": "A100 80 GB",
    "p5": "H100 80 GB",
    "p5e": "H200 141 GB",
    "p5en": "H200 141 GB",
    "p6-b200": "B200 179 GB",
    "g5": "A10G 24 GB",
    "g6": "L4 24 GB",
    "g6e": "L40S 48 GB",
}
"""Instance family (the part of the type before the '.') -> its GPU."""

_ONE_GPU = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")
_G_SIZES = {**dict.fromkeys(_ONE_GPU, 1), "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}

GPUS_PER_INSTANCE: dict[str, int] = {
    "p4d.24xlarge": 8,
    "p4de.24xlarge": 8,
    "p5.4xlarge": 1,
    "p5.48xlarge": 8,
    "p5e.48xlarge": 8,
    "p5en.48xlarge": 8,
    "p6-b200.48xlarge": 8,
    **{f"{family}.{size}": n for family in ("g5", "g6", "g6e") for size, n in _G_SIZES.items()},
}
"""Instance type -> NVIDIA GPUs of one instance."""


def family(instance_type: str) -> str:
    """The family of an instance type: ``"p5en.48xlarge"`` -> ``"p5en"``."""
    return instance_type.split(".", 1)[0]


def is_gpu_instance(instance_type: str) -> bool:
    """Whether the type is in one of ``GPU_FAMILIES``."""
    return family(instance_type) in GPU_FAMILIES


def gpus_of(instance_type: str) -> int | None:
    """GPUs of one instance of the type; None when the size is not in ``GPUS_PER_INSTANCE``."""
    return GPUS_PER_INSTANCE.get(instance_type)


def gpu_memory_gb(instance_type: str) -> float | None:
    """Memory of one GPU of the type in GB (10^9 bytes, as ``GPU_FAMILIES`` and AWS state it); None for
    a family not listed."""
    gpu = GPU_FAMILIES.get(family(instance_type))
    return float(gpu.split()[-2]) if gpu is not None else None
