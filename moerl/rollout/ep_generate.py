"""``moerl generate --ep-size N``: the same generation on N expert-parallel ranks (``EPEngine``).

The parent process starts N local processes joined in a process group (gloo on CPU, NCCL on CUDA; one
GPU each), each loads the model, builds its engine with the caller's ``build_engine`` (``moerl generate``
passes the run's ``make_engine``: the same engine as a run's EP rollout ranks), shards its experts
(``--ep-dispatcher``) and runs the prompts
``i % N == rank`` in lockstep with the others; the completions come back through per-rank files and
are returned in request order. Every collective has a timeout (``timeout_s``), and ranks still alive
after it are killed, so a hung rank fails the command instead of stalling it.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.rollout.engine import Engine
from moerl.rollout.ep_engine import EPEngine
from moerl.rollout.params import FINISH_ERROR, Completion, InvalidRequestError, Request


@dataclass(frozen=True, slots=True)
class EPGenerateSpec:
    """What each rank needs to build its engine."""

    model: str
    """Hugging Face model folder."""
    dtype: torch.dtype
    device: str
    """``cpu`` or ``cuda`` (rank r takes ``cuda:r``)."""
    build_engine: Callable[[torch.nn.Module], Engine]
    """The rank's engine over its model (a picklable callable: the spec travels to spawned processes)."""
    dispatcher: str
    """``alltoall`` or ``hierarchical``."""
    ranks_per_node: int | None
    """Node layout (simulated nodes on CPU); None: one node."""


def _error(req: Request, message: str) -> Completion:
    return Completion(
        request_id=req.request_id,
        sample_index=0,
        prompt_ids=list(req.prompt_ids),
        token_ids=[],
        logprobs=[],
        finish_reason=FINISH_ERROR,
        policy_versions=[],
        error=message,
    )


def _rank_main(rank: int, size: int, folder: str, spec: EPGenerateSpec, requests, timeout_s: float) -> None:
    from moerl.models import from_pretrained  # lazy: the model loader pulls in safetensors I/O

    out = Path(folder)
    try:
        torch.set_num_threads(1)
        is_cuda = spec.device.startswith("cuda")
        dist.init_process_group(
            "nccl" if is_cuda else "gloo",
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        device = f"cuda:{rank}" if is_cuda else "cpu"
        model = from_pretrained(spec.model, dtype=spec.dtype, device=device)
        engine = spec.build_engine(model)
        ep = EPEngine(engine, dispatcher=spec.dispatcher, ranks_per_node=spec.ranks_per_node)
        mine = [r for i, r in enumerate(requests) if i % size == rank]
        valid, errors = [], []
        for r in mine:
            try:
                engine.add_request(r)
                valid.append(r)
            except InvalidRequestError as e:
                errors.append(_error(r, str(e)))
        by_key = {}
        while ep.has_work_anywhere():
            for c in ep.step():
                by_key[(c.request_id, c.sample_index)] = c
        done = [by_key[(r.request_id, j)] for r in valid for j in range(r.params.n)] + errors
        # plain fields only, so that the reader can load with weights_only=True (no pickled classes)
        torch.save([dataclasses.asdict(c) for c in done], out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def generate_ep(
    spec: EPGenerateSpec, requests: list[Request], ep_size: int, *, timeout_s: float = 600.0
) -> list[Completion]:
    """Run ``requests`` on ``ep_size`` EP ranks (module docstring); completions in request order.

    Raises:
        ValueError: ``ep_size`` < 2.
        RuntimeError: a rank failed (its traceback in the message) or did not finish in ``timeout_s``.
    """
    if ep_size < 2:
        raise ValueError(f"--ep-size={ep_size}: expert parallelism needs at least 2 ranks")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_rank_main, args=(r, ep_size, folder, spec, requests, timeout_s), daemon=True)
            for r in range(ep_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()  # our own child, by handle
                p.join()
        errors = sorted(Path(folder).glob("error*.txt"))
        if errors:
            raise RuntimeError("an EP rank failed:\n" + errors[0].read_text())
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"EP ranks exited with codes {[p.exitcode for p in procs]}")
        done = [
            Completion(**fields)
            for r in range(ep_size)
            for fields in torch.load(Path(folder) / f"rank{r}.pt", weights_only=True)
        ]
    order = {r.request_id: i for i, r in enumerate(requests)}
    return sorted(done, key=lambda c: (order[c.request_id], c.sample_index))
