"""GPU utilization and memory through NVML (``pynvml`` from the ``gpu`` extra, package nvidia-ml-py).

Rollout workers read it for their heartbeat, the driver for the trainer; the Prometheus exporter
serves it as ``moerl_gpu_*{worker,gpu}``. Without pynvml, an NVIDIA driver or a GPU it is empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU as NVML reports it."""

    index: int
    """NVML device index (the physical GPU, not the CUDA-visible one)."""
    utilization: float
    """Fraction of the last sample period in which a kernel ran, in [0, 1]."""
    memory_used_bytes: int
    """Device memory in use, bytes (all processes)."""
    memory_total_bytes: int
    """Device memory, bytes."""


def read_gpus() -> tuple[GpuSample, ...]:
    """The GPUs this process may use, through NVML (``pynvml`` from the ``gpu`` extra).

    ``CUDA_VISIBLE_DEVICES`` (integer form) picks which NVML devices belong to this process; unset:
    all. Empty when pynvml is not installed, no NVIDIA driver is loaded, or there is no GPU.
    """
    try:
        import pynvml  # optional dependency (nvidia-ml-py), absent on CPU machines
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = range(pynvml.nvmlDeviceGetCount())
        if visible is not None and all(p.strip().isdigit() for p in visible.split(",") if p.strip()):
            indices = [int(p) for p in visible.split(",") if p.strip()]
        out = []
        for i in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            out.append(GpuSample(i, util.gpu / 100.0, int(mem.used), int(mem.total)))
        return tuple(out)
    except pynvml.NVMLError:
        return ()
    finally:
        pynvml.nvmlShutdown()
