"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP), loadable at any world size.

Every rank writes its own shards of the model and of the AdamW moments (and of the critic's value model
and its moments, with PPO) into one DCP folder, under
the names and *global* shapes of the one-rank model: a dense parameter is its FSDP2 DTensor over the
world mesh; an EP expert tensor, held as [L, ...] rows of its EP rank's experts, is presented as a
DTensor [E, ...] placed ``(Shard(0), Shard(0))`` on the ("ep", "dp") mesh. DCP records which global
rows each file holds, so a load at another number of ranks (or EP degree, or one rank without any
process group) reads exactly the rows each new shard needs. DCP writes its ``.metadata`` last; the step
folder's ``meta.json``, written after it by the driver (``moerl.trainer.checkpoint.save_checkpoint``),
records the size and xxh3-128 digest of every file of the DCP folder, checked before a resume loads it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from moerl.ep.parallelize import ExpertParallelExperts
from moerl.trainer.distributed.mesh import TrainMesh


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint does not match the model being loaded (the message says what differs)."""


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _global(t: torch.Tensor, mesh: TrainMesh | None, num_experts: int | None) -> torch.Tensor:
    """The checkpoint view of a parameter (or a moment of it): EP expert rows as [E, ...] DTensors."""
    if num_experts is None or mesh is None:
        return t
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (num_experts, *local.shape[1:])
    return DTensor.from_local(
        local,
        mesh.ep_major,
        [Shard(0), Shard(0)],
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero AdamW state for parameters without any (before the first step), so DCP can load into it."""
    fused = bool(optimizer.defaults.get("fused"))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: TrainMesh | None) -> tuple:
    """(model state, AdamW state by parameter name) of one module in the global view."""
    experts = {
        f"{n}.{p}": m.dispatcher.num_experts
        for n, m in model.named_modules()
        if isinstance(m, ExpertParallelExperts)
        for p in ("gate_up_proj", "down_proj")
    }
    state = {n: _global(t, mesh, experts.get(n)) for n, t in model.state_dict().items()}
    _ensure_adam_state(optimizer)
    optim = {}
    for name, p in model.named_parameters():
        s = optimizer.state[p]
        optim[name] = {
            "step": s["step"],
            "exp_avg": _global(s["exp_avg"], mesh, experts.get(name)),
            "exp_avg_sq": _global(s["exp_avg_sq"], mesh, experts.get(name)),
        }
    return state, optim


def checkpoint_state(trainer, mesh: TrainMesh | None) -> dict:
    """``{"model": {name: tensor}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}`` in the global
    view, sharing storage with the trainer's tensors (DCP loads in place); with a critic (PPO) also
    ``"critic_model"`` and ``"critic_optim"``, its value model and AdamW state in the same layout."""
    model_state, optim = _module_state(trainer.model, trainer.optimizer, mesh)
    out = {"model": model_state, "optim": optim}
    critic = getattr(getattr(trainer, "algo", None), "critic", None)
    if critic is not None:
        out["critic_model"], out["critic_optim"] = _module_state(critic.model, critic.optimizer, mesh)
    return out


def save_sharded(trainer, folder: str | Path, mesh: TrainMesh | None = None) -> None:
    """Write the trainer's model and optimizer shards into the DCP folder ``folder`` (collective)."""
    dcp.save(checkpoint_state(trainer, mesh or getattr(trainer, "mesh", None)), checkpoint_id=str(folder))


def set_lr_from_scheduler(trainer) -> None:
    """Set each optimizer group's lr to the (just loaded) LR scheduler's last value."""
    for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def load_critic_scheduler(trainer, state: dict | None) -> None:
    """Restore the critic's LR scheduler (and its optimizer's lr) from ``state``; nothing without a critic
    or a state (a checkpoint written before the critic was saved keeps the fresh schedule)."""
    critic = getattr(getattr(trainer, "algo", None), "critic", None)
    if critic is None or state is None:
        return
    critic.scheduler.load_state_dict(state)
    for group, lr in zip(critic.optimizer.param_groups, critic.scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def load_sharded(trainer, folder: str | Path, mesh: TrainMesh | None = None) -> None:
    """Fill the trainer's model and optimizer from the DCP folder ``folder``, whatever world size wrote it
    (collective on a sharded trainer; a one-rank ``Trainer`` reads it without a process group).

    Raises:
        ShardedCheckpointError: the folder is not a complete DCP checkpoint, or its tensors' names or
            shapes differ from this model's (named).
    """
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ShardedCheckpointError(f"{folder}: not a complete sharded checkpoint (no .metadata)")
    state = checkpoint_state(trainer, mesh or getattr(trainer, "mesh", None))
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    for key, want in _flat_shapes(state).items():
        got = meta.get(key)
        if got is None:
            raise ShardedCheckpointError(
                f"{folder}: the checkpoint has no tensor {key}; it belongs to another model"
            )
        size = tuple(getattr(got, "size", ()))
        if size != want:
            raise ShardedCheckpointError(
                f"{folder}: tensor {key} has shape {size} in the checkpoint; the model has {want}"
            )
    with torch.no_grad():
        # A one-rank Trainer has no process group: that is the intent, so say it (no_dist). torch 2.13
        # warns "assuming the intent is to load in a single process" even then; that one line is dropped.
        no_dist = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=str(folder), no_dist=no_dist)


def _flat_shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_shapes(v, key + "."))
        else:
            out[key] = tuple(v.shape)
    return out
