"""The paged decode attention kernel on the GPU: agreement with its definition and time against the gather
path the paged cache used before it (index_select of every row's W * bs keys, then SDPA).

    python bench/paged_attention_gpu.py --out bench/results/paged_attention_gpu.json

Shapes of the benchmarks' reference model (16 kv heads of 128, block 16) in bfloat16; per case B rows whose
lengths are uniform (all at the context) or long-tailed (lognormal, median 800 tokens, 1% at 8k: a prompt
of 512 plus ``bench/paged_kv.py``'s responses). Times from CUDA graphs replayed 50 times (``do_bench``),
so launch overheads are what a captured decode step pays. Bytes moved: each row's own keys and values
(the kernel's floor at the measured copy bandwidth is printed beside it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from moerl.rollout.paged_attention import (
    PrefixGroups,
    paged_decode_attention,
    paged_decode_reference,
    prefix_group_rows,
    prefix_max_groups,
)

try:
    from triton.testing import do_bench_cudagraph
except ImportError:  # the GPU machine has Triton; a CPU checkout may not
    do_bench_cudagraph = None


def lengths_for(kind: str, b: int, context: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.full((b,), context, dtype=torch.int64)
    sigma = math.log(8192 / 800) / 2.326
    x = torch.exp(math.log(800) + sigma * torch.randn(b, generator=gen, dtype=torch.float64))
    return x.round().clamp(1, context).to(torch.int64)


def gather_path(q, kc, vc, table, lengths, scale, bs):
    """The pre-kernel path: gather W * bs keys per row, mask, SDPA (kv heads repeated as on CUDA)."""
    b, nh, d = q.shape
    w = table.shape[1]
    slots = (table[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(b, w * bs)
    k = kc.index_select(0, slots.reshape(-1)).view(b, w * bs, kc.shape[1], -1).transpose(1, 2)
    v = vc.index_select(0, slots.reshape(-1)).view(b, w * bs, vc.shape[1], -1).transpose(1, 2)
    mask = (torch.arange(w * bs, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale)[:, :, 0]


def shared_prefix_rows(dev, gen, nkv: int, nh: int, d: int, bs: int) -> list[dict]:
    """GRPO groups: 256 rows in 32 groups of 8, each group's rows reading the same 512-token prompt blocks
    (the paged cache shares them) and then 300 tokens of their own; against the same lengths with every
    row's prompt in blocks of its own (a slot cache's layout), and the shared layout with its groups named
    (``PrefixGroups``: the shared prompt read once per group, cascade attention), checked against the
    definition."""
    out = []
    b, group, prompt, own = 256, 8, 512, 300
    lengths = torch.full((b,), prompt + own, dtype=torch.int64)
    pb, ob = prompt // bs, -(-own // bs)
    for layout in ("shared", "distinct"):
        n_prompt_blocks = (b // group if layout == "shared" else b) * pb
        nb = n_prompt_blocks + b * ob
        kc = torch.randn(nb * bs + bs, nkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(nb * bs + bs, nkv, d, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(nb, generator=gen)
        table = torch.empty((b, pb + ob), dtype=torch.int64)
        for i in range(b):
            first = (i // group if layout == "shared" else i) * pb
            table[i, :pb] = perm[first : first + pb]
            table[i, pb:] = perm[n_prompt_blocks + i * ob : n_prompt_blocks + (i + 1) * ob]
        table, lens = table.to(dev), lengths.to(dev)
        q = torch.randn(b, nh, d, device=dev, dtype=torch.bfloat16)
        call = functools.partial(paged_decode_attention, q, kc, vc, table, lens, d**-0.5, bs)
        t = do_bench_cudagraph(call) * 1e-3
        unique = (n_prompt_blocks + b * ob) * bs * nkv * d * 2 * 2
        row = dict(
            kind=f"groups_{layout}_prompt",
            rows=b,
            group=group,
            prompt=prompt,
            own=own,
            kernel_s=t,
            unique_kv_bytes=unique,
            unique_gb_per_s=unique / t / 1e9,
        )
        if layout == "shared":  # the same batch with its groups named: each prompt read once per group
            gr = prefix_group_rows(nh // nkv)
            n = torch.zeros(b, dtype=torch.int32)
            plen, start = torch.zeros(b, dtype=torch.int64), torch.full((b,), prompt, dtype=torch.int64)
            rows = torch.zeros(b, gr, dtype=torch.int64)
            for lead in range(0, b, group):
                n[lead], plen[lead] = group, prompt
                rows[lead, :group] = torch.arange(lead, lead + group)
            leaders = torch.full((prefix_max_groups(b),), -1, dtype=torch.int64)
            leaders[: b // group] = torch.arange(0, b, group)
            groups = PrefixGroups(leaders.to(dev), n.to(dev), plen.to(dev), rows.to(dev), start.to(dev))
            grouped = functools.partial(call, prefix=groups)
            ref = paged_decode_reference(q, kc, vc, table, lens, d**-0.5, bs)
            row["grouped_max_abs_err_vs_definition"] = float((grouped().float() - ref.float()).abs().max())
            row["grouped_kernel_s"] = do_bench_cudagraph(grouped) * 1e-3
            row["grouped_speedup"] = t / row["grouped_kernel_s"]
        out.append(row)
        print(json.dumps(out[-1]), flush=True)
    out[0]["shared_over_distinct_time"] = out[0]["kernel_s"] / out[1]["kernel_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/paged_attention_gpu.json")
    ap.add_argument("--sweep", action="store_true", help="also time block_n x num_warps x num_stages")
    args = ap.parse_args()

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    nkv, nh, d, bs = 16, 16, 128, 16
    rows = []
    for kind, b, context in [
        ("uniform", 256, 256),
        ("uniform", 64, 4096),
        ("long_tail", 256, 8704),
        ("long_tail", 64, 8704),
        ("long_tail", 8, 8704),  # a wide table over few rows: several splits of each row's own length
    ]:
        lengths = lengths_for(kind, b, context, gen)
        w = -(-int(lengths.max()) // bs)
        nb = int(sum(-(-int(n) // bs) for n in lengths)) + 1
        kc = torch.randn(nb * bs + bs, nkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(nb * bs + bs, nkv, d, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(nb, generator=gen)
        table = torch.full((b, w), nb, dtype=torch.int64)
        at = 0
        for i, n in enumerate(lengths.tolist()):
            k = -(-n // bs)
            table[i, :k] = perm[at : at + k]
            at += k
        table, lengths = table.to(dev), lengths.to(dev)
        q = torch.randn(b, nh, d, device=dev, dtype=torch.bfloat16)
        scale = d**-0.5
        call = functools.partial(paged_decode_attention, q, kc, vc, table, lengths, scale, bs)
        out = call()
        ref = paged_decode_reference(q, kc, vc, table, lengths, scale, bs)
        err = float((out.float() - ref.float()).abs().max())
        t_kernel = do_bench_cudagraph(call) * 1e-3
        t_gather = (
            do_bench_cudagraph(functools.partial(gather_path, q, kc, vc, table, lengths, scale, bs)) * 1e-3
        )
        kv_bytes = int(lengths.sum()) * nkv * d * 2 * 2
        sweep = {}
        if args.sweep:
            for bn in (32, 64, 128):
                for nw in (2, 4, 8):
                    for ns in (1, 2, 3):
                        kw = dict(block_n=bn, num_warps=nw, num_stages=ns)
                        try:
                            t = do_bench_cudagraph(functools.partial(call, **kw))
                            sweep[f"bn{bn}_w{nw}_s{ns}"] = t * 1e-3
                        except Exception as e:  # a config the compiler refuses (shared memory)
                            sweep[f"bn{bn}_w{nw}_s{ns}"] = repr(e)[:80]
        rows.append(
            dict(
                kind=kind,
                rows=b,
                read_width_tokens=w * bs,
                mean_length=float(lengths.float().mean()),
                max_abs_err_vs_definition=err,
                kernel_s=t_kernel,
                gather_s=t_gather,
                speedup=t_gather / t_kernel,
                kernel_kv_bytes=kv_bytes,
                kernel_gb_per_s=kv_bytes / t_kernel / 1e9,
                sweep_s=sweep,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    rows += shared_prefix_rows(dev, gen, nkv, nh, d, bs)
    payload = dict(
        benchmark="paged_attention_gpu",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        heads=dict(nh=nh, nkv=nkv, d=d, bs=bs),
        rows=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
