"""GPU check of ``moerl.rollout.memory_check`` (one H200): the CUDA reading, the default config passing, an
oversized engine refused, and the estimate against the bytes a real model and engine allocate on CUDA.

    PYTHONPATH=. python3 bench/memory_check_gpu.py
"""

from __future__ import annotations

import torch

from moerl.config import ConfigError, load_config
from moerl.models.dtypes import torch_dtype
from moerl.models.model import MoeForCausalLM
from moerl.rollout.engine import Engine
from moerl.rollout.memory_check import available_bytes, check_memory, policy_arch

VOCAB = 512


def main() -> int:
    """Print the four checks; exit 1 when the oversized config is not refused."""
    dev = torch.device("cuda:0")
    free, source = available_bytes(dev)
    print(f"available {free / 2**30:.2f} GiB ({source})")
    cfg = load_config(None, ["model.device=cuda", "runtime.mode=sync"])
    est = check_memory(cfg, VOCAB)
    print(f"default config on cuda passes: {est}")
    big = ["rollout.max_slots=1000000", "rollout.kv_token_budget=512000000"]
    refused = False
    try:
        check_memory(load_config(None, ["model.device=cuda", "runtime.mode=sync", *big]), VOCAB)
    except ConfigError as e:
        refused = True
        print(f"oversized refused: {e}")
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_allocated()
    model = MoeForCausalLM(policy_arch(cfg, VOCAB)).to(device=dev, dtype=torch_dtype(cfg.model.dtype))
    a1 = torch.cuda.memory_allocated()
    engine = Engine.from_config(model, cfg.rollout)  # kept alive until its cache is measured
    torch.cuda.synchronize()
    a2 = torch.cuda.memory_allocated()
    print(f"weights allocated {a1 - a0} B, estimate {est.weight_bytes} B")
    print(f"engine allocated {a2 - a1} B, estimate {est.engine_bytes} B ({engine.__class__.__name__})")
    return 0 if refused else 1


if __name__ == "__main__":
    raise SystemExit(main())
