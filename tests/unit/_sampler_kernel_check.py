"""Run under ``TRITON_INTERPRET=1`` with Triton on the path (``test_sampler.py`` does): the one-kernel
``uniform_no_sync`` against its tensor ops, bit for bit. Prints one JSON line."""

import json

import torch

from moerl.rollout import sampler

g = torch.Generator().manual_seed(0)
keys = torch.randint(0, 2**32, (3000,), generator=g, dtype=torch.int64)
keys[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
pos = torch.randint(0, 2**31, (3000,), generator=g, dtype=torch.int64)
pos[:4] = torch.tensor([0, 2**31 - 1, 5, 2**32 - 1])
cases = {
    "flat": (keys, pos),
    "grid": (keys[:40, None].expand(40, 13).contiguous(), pos[:40, None] + torch.arange(13)),
    "broadcast": (keys[:40, None], pos[:40, None] + torch.arange(13)),  # [40, 1] with [40, 13]
    "empty": (keys[:0], pos[:0]),
}
res = {}
for name, (k, p) in cases.items():
    got, want = sampler._uniform_triton(k, p), sampler.uniform_reference(k, p)
    res[name] = {"shape": list(got.shape), "equal": bool(torch.equal(got, want)) and got.shape == want.shape}
calls = []
kernel = sampler._uniform_triton
sampler._uniform_triton = lambda k, p: calls.append(1) or kernel(k, p)
same = torch.equal(sampler.uniform_no_sync(keys, pos), sampler.uniform_reference(keys, pos))
res["dispatched"] = bool(same) and len(calls) == 1  # uniform_no_sync took the kernel
print(json.dumps(res))
