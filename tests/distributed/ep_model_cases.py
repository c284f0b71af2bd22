"""Model-level EP check run inside a spawned gloo world: a Qwen3-MoE model with its experts sharded by
``moerl.ep.parallelize`` (EP = world size) against the same model on one rank (EP = 1).

Data parallel over the batch: rank r runs sequences r::R. The loss is the token-summed cross-entropy
divided by the global token count, so summing the replicated parameters' gradients over ranks gives
the EP = 1 gradient; expert gradients are complete on their owning rank without any reduction.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moerl.config import ModelConfig
from moerl.ep import AllToAllDispatcher, HierarchicalDispatcher, Topology
from moerl.ep.parallelize import ExpertParallelExperts, parallelize, replicated_parameters
from moerl.models import build_model

VOCAB = 61


def _loss_sum(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids, mask).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1), reduction="none")
    return logits, (ce * mask[:, 1:].reshape(-1)).sum()


def run_model_case(rank: int, world: int, ranks_per_node: int) -> dict:
    """Returns, per dispatcher, the max relative errors of logits, loss and every gradient."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        family="qwen3_moe",
        hidden_size=40,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=10,
        num_experts=8,
        top_k=3,
        moe_intermediate_size=24,
    )
    reference = build_model(cfg, VOCAB)
    ids = torch.randint(0, VOCAB, (2 * world, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # one padded sequence
    num_tokens = mask[:, 1:].sum()
    ref_logits, ref_loss = _loss_sum(reference, ids, mask)
    (ref_loss / num_tokens).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    out = {}
    topo = Topology(world, ranks_per_node)
    for name, cls in (("alltoall", AllToAllDispatcher), ("hierarchical", HierarchicalDispatcher)):
        model = parallelize(copy.deepcopy(reference), dispatcher=cls(topo, cfg.num_experts))
        model.zero_grad(set_to_none=True)
        mine = slice(rank, None, world)
        logits, loss = _loss_sum(model, ids[mine], mask[mine])
        (loss / num_tokens).backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors = {"logits": _rel(logits, ref_logits[mine]), "loss": _rel(total, ref_loss)}
        replicated = dict(replicated_parameters(model))
        for pname, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if pname in replicated:
                dist.all_reduce(grad)  # data-parallel gradient sum
                want = ref_grads[pname]
            else:  # expert shard: complete on its rank
                want = ref_grads[pname][model.get_submodule(pname.rsplit(".", 1)[0]).local_expert_ids]
            errors[f"grad:{pname}"] = _rel(grad, want)
        with torch.no_grad():  # inference (rollout engine) path
            errors["no_grad_logits"] = _rel(model(ids[mine], mask[mine]).logits, ref_logits[mine])
        out[name] = errors
        out[f"{name}_sharded"] = sum(isinstance(m, ExpertParallelExperts) for m in model.modules())
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are all zero)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
