"""Build the policy sharded over a ``TrainMesh``: meta device -> EP -> FSDP2 -> load only this rank's shard.

Shape legend: E routed experts, P EP ranks, L = E / P local experts, D = R / P data-parallel replicas
of an expert shard, N rows of a parameter's dim 0.

Following torchtitan's ``parallelize``: the model is built on the meta device (no memory), its MoE
blocks' experts are swapped for this EP rank's L experts (``moerl.ep.parallelize``), every
``ExpertParallelExperts`` is ``fully_shard``-ed over the "dp" mesh, every decoder layer and the root
over the whole world. Only then is memory allocated, for this rank's shards, and filled from the
Hugging Face folder with ``safetensors`` slices: no process ever holds the whole model.

FSDP2 shards dim 0 of each parameter in ``ceil(N / mesh size)`` row chunks (the last ones may be
short or empty). Gradients are summed, not averaged, over the mesh (``set_gradient_divide_factor(1)``):
the loss already divides by the global token count, so the sum is the one-rank gradient.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from moerl.ep.parallelize import ExpertParallelExperts, parallelize
from moerl.ep.registry import build_dispatcher
from moerl.models.checkpoint import CheckpointError
from moerl.models.config import MoeConfig
from moerl.models.keymaps import KeyMapper
from moerl.models.model import MoeForCausalLM
from moerl.trainer.critic import with_value_head
from moerl.trainer.distributed.mesh import TrainMesh


def local_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """Rows ``[start, stop)`` of dim 0 of ``t``'s global tensor held by this rank, or None when ``t``
    is not sharded (a plain tensor: a buffer)."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    n = t.shape[0]
    chunk = -(-n // mesh.size())
    start = min(mesh.get_local_rank() * chunk, n)
    stop = start + t.to_local().shape[0]
    if stop > n:
        raise RuntimeError(f"unexpected FSDP2 shard: rows [{start}, {stop}) of {n}")
    return start, stop


def shard_model(model: MoeForCausalLM, mesh: TrainMesh) -> MoeForCausalLM:
    """``fully_shard`` the experts over "dp", the decoder layers and the root over the world (in place).

    Gradient reductions sum over the mesh (no division), in every FSDP2 module.
    """
    for block in model.moe_blocks():
        if isinstance(block.experts, ExpertParallelExperts):
            fully_shard(block.experts, mesh=mesh.dp_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh.world)
    fully_shard(model, mesh=mesh.world)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _key_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file holding it (reads only the files' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))  # noqa: SIM118 - safe_open is not a Mapping
    return out


class _ShardReader:
    """Reads slices of checkpoint tensors, one open file handle per safetensors file."""

    def __init__(self, folder: Path, stack: contextlib.ExitStack) -> None:
        self.folder, self.files, self.stack, self.handles = folder, _key_files(folder), stack, {}

    def has(self, key: str) -> bool:
        return key in self.files

    def rows(self, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``key`` (all of it for None)."""
        if key not in self.files:
            raise CheckpointError(f"{self.folder}: missing weight key {key}")
        file = self.files[key]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        view = self.handles[file].get_slice(key)
        return view[:] if rows is None else view[rows[0] : rows[1]]


def _expert_rows(reader: _ShardReader, mapper: KeyMapper, name: str, ids: list[int]) -> torch.Tensor:
    """Experts ``ids`` of the moerl expert tensor ``name``, stacked [len(ids), ...]."""
    layer = int(name.split(".")[1])
    if name.endswith("down_proj"):
        parts = [reader.rows(mapper.expert_key(layer, e, "down"), None) for e in ids]
        return torch.stack(parts) if parts else torch.empty(0)
    key = mapper.to_hf(name)
    if reader.has(key):  # fused [E, 2I, H] layout
        return torch.stack([reader.rows(key, (e, e + 1))[0] for e in ids]) if ids else torch.empty(0)
    parts = [
        torch.cat([reader.rows(mapper.expert_key(layer, e, p), None) for p in ("gate", "up")]) for e in ids
    ]
    return torch.stack(parts) if parts else torch.empty(0)


@torch.no_grad()
def load_local_shards(model: MoeForCausalLM, folder: str | Path, *, skip_prefix: str | None = None) -> None:
    """Fill this rank's shards of ``model`` (already ``to_empty``-ed) from a Hugging Face folder; tensors
    whose name starts with ``skip_prefix`` are left as they are (a value head the folder does not hold).

    Raises:
        CheckpointError: a key the model needs is missing, or a tensor has another shape.
    """
    folder = Path(folder)
    cfg = model.config
    mapper = KeyMapper(cfg.model_type, cfg.num_hidden_layers)
    global_ids = {}
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            global_ids[i] = experts.dispatcher.local_experts.tolist()
    with contextlib.ExitStack() as stack:
        reader = _ShardReader(folder, stack)
        for name, t in model.state_dict().items():
            if skip_prefix is not None and name.startswith(skip_prefix):
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            rows = local_rows(t)
            if ".experts." in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj"):
                layer = int(name.split(".")[1])
                ids = list(range(t.shape[0])) if layer not in global_ids else global_ids[layer]
                src = _expert_rows(reader, mapper, name, ids[rows[0] : rows[1]] if rows else ids)
            else:
                src = reader.rows(mapper.to_hf(name), rows)
            if local.numel() == 0:
                continue
            if tuple(src.shape) != tuple(local.shape):
                raise CheckpointError(
                    f"{folder}: tensor for {name} has shape {tuple(src.shape)}; this rank's shard of the "
                    f"model needs {tuple(local.shape)}"
                )
            local.copy_(src)


def build_sharded_policy(
    folder: str | Path,
    mesh: TrainMesh,
    *,
    ep_dispatcher: str = "alltoall",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    value_head: bool = False,
) -> MoeForCausalLM:
    """The policy of the Hugging Face folder ``folder``, sharded over ``mesh`` (collective).

    ``value_head=True``: the LM head is replaced by PPO's zero-initialized value head ``[H] -> 1``
    (``moerl.trainer.critic.with_value_head``, before sharding) and the rest is loaded from ``folder``:
    the critic's value model, a copy of the policy's trunk.

    Raises:
        CheckpointError: the folder does not hold the model its config.json describes.
        ValueError: tied input/output embeddings (not supported sharded yet), or E not a multiple of P.
    """
    folder = Path(folder)
    cfg = MoeConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    if cfg.tie_word_embeddings:
        raise ValueError(f"{folder}: tied word embeddings are not supported by the sharded trainer yet")
    with torch.device("meta"):
        model = MoeForCausalLM(cfg).to(dtype)
        if value_head:
            with_value_head(model)
    if mesh.ep_size > 1:
        if cfg.num_experts % mesh.ep_size:
            raise ValueError(f"ep_size={mesh.ep_size} does not divide the model's {cfg.num_experts} experts")
        dispatcher = build_dispatcher(ep_dispatcher, mesh.topology, cfg.num_experts, mesh.ep_group)
        parallelize(model, dispatcher=dispatcher)
    shard_model(model, mesh)
    model.to_empty(device=device)
    model.keep_router_buffers_fp32()
    for m in model.modules():  # to_empty left the non-persistent buffers uninitialized
        if isinstance(m, ExpertParallelExperts):
            m.local_expert_ids = m.dispatcher.local_experts.to(device)
    model.rotary = model.build_rotary().to(device)
    load_local_shards(model, folder, skip_prefix="lm_head." if value_head else None)
    if value_head:
        with torch.no_grad():
            for p in model.lm_head.parameters():  # V = 0 at first, as in the one-rank critic
                (p.to_local() if isinstance(p, DTensor) else p).zero_()
    return model


def unwrap_experts(model: nn.Module) -> list[ExpertParallelExperts]:
    """The model's EP expert shards, in layer order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
