"""bench/spec_step_profile.py's operator counter (the CPU-measurable kernel count of a decode step):
kernel-launching aten operators only (views left out), attributed to the region that ran them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.spec_step_profile import OpCounter, ops_per_step  # noqa: E402


def test_counts_kernel_operators_per_call_and_region_not_views():
    x = torch.ones(4)
    counter = OpCounter()

    def step():
        y = (x + 1).view(2, 2).t().unsqueeze(0)  # one kernel (add); view, t, unsqueeze launch none
        counter.region = "draft"
        z = (y * 2).sum()  # two kernels in "draft"
        counter.region = "other"
        return z

    assert ops_per_step(step, 3, counter) == {"all": 3.0, "draft": 2.0, "other": 1.0}
    assert ops_per_step(lambda: x.reshape(2, 2).expand(3, 2, 2), 2) == {"all": 0.0}
