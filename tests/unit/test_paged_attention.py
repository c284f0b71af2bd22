"""The paged decode attention kernel (``moerl.rollout.paged_attention``) on CPU through Triton's interpreter:
equal to its tensor-op definition, and the paged engine decoding through it equal to the slot engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moerl.rollout.paged_attention import paged_decode_attention, paged_decode_reference

ROOT = Path(__file__).resolve().parents[2]
TRITON = (
    ROOT / ".cache" / "triton-interp"
)  # bash tests/setup.sh installs Triton here (only this test uses it)


def test_reference_is_softmax_attention_over_each_rows_own_keys():
    torch.manual_seed(0)
    bs, nkv, nh, d = 4, 2, 4, 8
    kc, vc = torch.randn(10 * bs, nkv, d), torch.randn(10 * bs, nkv, d)
    table = torch.tensor([[3, 1, 7], [0, 2, 9]])
    lengths = torch.tensor([9, 2])
    q = torch.randn(2, nh, d)
    out = paged_decode_reference(q, kc, vc, table, lengths, 0.5, bs)
    for b in range(2):
        slots = torch.cat([table[b, j] * bs + torch.arange(bs) for j in range(3)])[: lengths[b]]
        k = kc[slots].repeat_interleave(nh // nkv, dim=1)  # [L, nh, d]
        v = vc[slots].repeat_interleave(nh // nkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b], k) * 0.5, dim=-1)
        assert torch.allclose(out[b], torch.einsum("hl,lhd->hd", p, v), atol=1e-6)
    with pytest.raises(ValueError, match="do not fit together"):
        paged_decode_attention(torch.randn(2, 3, d), kc, vc, table, lengths, 0.5, bs)


def test_kernel_under_the_interpreter_equals_the_definition_and_the_slot_engine():
    if not (TRITON / "triton").is_dir():
        pytest.fail(f"Triton is not installed in {TRITON}: bash tests/setup.sh installs it", pytrace=False)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{TRITON}")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/unit/_paged_kernel_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(res["kernel_errors"]) < 2e-6, res
    assert max(res["prefix_kernel_errors"]) < 2e-6, res  # groups of rows reading shared blocks once
    eng = res["engine"]
    assert eng["kernel_calls"] > 0, "the paged engine never decoded through the kernel"
    assert eng["grouped_kernel_calls"] > 0, "the engine never read a group's shared prompt once"
    slots = res["group_slots"]  # more groups than the shared-prefix pass's slots: the rest read their own
    assert slots["capped_batches"] > 0 and slots["tokens_equal"], slots
    for name, v in res["verify_groups"].items():  # a speculative verify's rows read their prefix once
        assert v["tokens_equal"] and v["max_logprob_diff"] < 1e-5, (name, v)
        assert v["spec_steps"] > 0 and v["grouped_calls"] > 0, (name, v)
    assert slots["max_logprob_diff"] < 1e-5, slots
    for mode in ("greedy", "sampled"):
        assert eng[mode]["tokens_equal"], (mode, eng)
        assert eng[mode]["max_logprob_diff"] < 1e-5, (mode, eng)
        assert eng[mode]["preemptions"] > 0, (mode, eng)
