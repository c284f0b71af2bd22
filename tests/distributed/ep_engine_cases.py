"""Per-rank body of the EP engine equivalence test (imported by the fork server; see dist_harness)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from moerl.config import ModelConfig
from moerl.models import build_model
from moerl.rollout import Engine, Request, SamplingParams
from moerl.rollout.ep_engine import EPEngine

VOCAB = 61


def make_model() -> torch.nn.Module:
    """A 2-layer float32 Qwen3-MoE with 4 experts (top-2) and O(1) weights (decisive greedy logits)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
        max_position_embeddings=128,
    )
    m = build_model(cfg, VOCAB)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return m.eval()


def requests() -> list[Request]:
    """Greedy requests of different prompt lengths and sample counts."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i, (n_prompt, n) in enumerate([(5, 1), (9, 2), (3, 1), (7, 1), (4, 2)]):
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=g).tolist()
        out.append(
            Request(
                request_id=f"r{i}",
                prompt_ids=prompt,
                params=SamplingParams(temperature=0.0, max_new_tokens=8 + i, n=n),
            )
        )
    return out


def late_request() -> Request:
    return Request(
        request_id="late", prompt_ids=[1, 2, 3, 4], params=SamplingParams(temperature=0.0, max_new_tokens=6)
    )


def new_engine(model) -> Engine:
    return Engine(copy.deepcopy(model), max_slots=4, kv_token_budget=4 * 64)


def _assign(reqs, rank, world, idle_rank):
    """Round-robin over the ranks other than ``idle_rank`` (None: over all)."""
    busy = [r for r in range(world) if r != idle_rank]
    return [q for i, q in enumerate(reqs) if busy[i % len(busy)] == rank]


def _as_plain(completions):
    return [(c.request_id, c.sample_index, c.token_ids, c.logprobs) for c in completions]


def run_engine_cases(rank: int, world: int, ranks_per_node: int) -> dict:
    """For each dispatcher: a batch over all ranks, a batch that leaves the last rank idle, and a
    request admitted mid-run on rank 0 (continuous batching)."""
    base = make_model()
    out = {}
    for disp in ("alltoall", "hierarchical"):
        rpn = ranks_per_node if disp == "hierarchical" else None
        for case, idle in (("all", None), ("idle_last", world - 1)):
            ep = EPEngine(new_engine(base), dispatcher=disp, ranks_per_node=rpn)
            out[f"{disp}/{case}"] = _as_plain(ep.generate(_assign(requests(), rank, world, idle)))
        ep = EPEngine(new_engine(base), dispatcher=disp, ranks_per_node=rpn)
        for q in _assign(requests(), rank, world, None):
            ep.add_request(q)
        done, steps = [], 0
        while ep.has_work_anywhere():
            done += ep.step()
            steps += 1
            if steps == 3 and rank == 0:
                ep.add_request(late_request())  # admitted while the others run
        out[f"{disp}/late"] = _as_plain(done)
        out[f"{disp}/experts"] = [int(b.experts.gate_up_proj.shape[0]) for b in ep.engine.model.moe_blocks()]
    dist.barrier()
    return out


def paged_requests(routed: bool = True) -> list[Request]:
    """Sampled groups of 8 (with routed experts when ``routed``): two prompts sharing a 12-token
    preamble, one alone."""
    g = torch.Generator().manual_seed(7)
    pre = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    prompts = [pre + [3, 4], pre + [5, 6, 7, 8, 9], torch.randint(0, VOCAB, (6,), generator=g).tolist()]
    params = dict(temperature=0.9, max_new_tokens=16, n=8, return_routed_experts=routed)
    return [
        Request(request_id=f"p{i}", prompt_ids=p, params=SamplingParams(seed=i, **params))
        for i, p in enumerate(prompts)
    ]


def run_paged_cases(rank: int, world: int, ranks_per_node: int) -> dict:
    """Paged engines (a budget small enough to preempt) under EP: each rank runs its share of the groups."""
    base = make_model()
    engine = Engine(copy.deepcopy(base), cache="paged", max_slots=16, kv_token_budget=96, block_size=4)
    ep = EPEngine(engine)
    mine = [q for i, q in enumerate(paged_requests()) if i % world == rank]
    done = ep.generate(mine)
    out = {
        "completions": [
            (*c, r.tolist()) for c, r in zip(_as_plain(done), [c.routed_experts for c in done], strict=True)
        ],
        "preemptions": engine.stats.preemptions,
        "prefix_hits": engine.stats.prefix_hit_tokens,
    }
    dist.barrier()
    return out
