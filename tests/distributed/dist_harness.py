"""Run a function on W local processes joined in a gloo process group, and collect what each returns.

Each world is started once per configuration and a worker runs many cases and returns their results;
tests then assert per case. Workers fork from a ``forkserver`` that has imported torch once (importing
torch costs seconds of CPU per process on 2 cores), so a world of 8 starts in about a second; the
server is single-threaded and has no process group, which makes forking from it safe.
Every collective has a timeout (``init_process_group(timeout=...)``) and the parent kills workers
that outlive ``timeout_s``, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 60


def _entry(fn: Callable[..., Any], rank: int, world_size: int, folder: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(folder)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"result{rank}.tmp")
        os.replace(out / f"result{rank}.tmp", out / f"result{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


HERE = Path(__file__).resolve().parent
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # imported lazily by the first meta-device init (build_sharded_policy): seconds a rank
    "moerl.ep",
    "moerl.trainer.distributed.rank",  # also what sync runs' local trainer ranks import (LocalRanks)
    *sorted(p.stem for p in HERE.glob("*_cases.py")),
]
"""What the fork server imports once, for every world of this process: torch, ``torch._dynamo`` (which
torch imports only at a process's first meta-device init, as every sharded trainer rank builds its
model: 2-10 s of CPU a rank on the loaded 2 cores, paid again by every rank of every world), the
trainer's rank code (DTensor, FSDP2) and every ``*_cases`` module. The server serves each world of the xdist worker, so
a list of only the first world's cases left every later world's ranks importing their own (1-2 s of
CPU a rank on 2 cores); all of them cost the server 0.4 s more, once."""


def start_fork_server(extra: tuple[str, ...] = ()) -> None:
    """Start this process's ``forkserver`` with ``_PRELOAD`` (and ``extra``) imported, if not running yet.

    Local trainer ranks of sync runs (``moerl.trainer.distributed.group.LocalRanks``) fork from the same
    server: once it runs, their own preload list is not used and they get this one, which holds theirs.
    """
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload([*_PRELOAD, *extra])
    # the server imports its list before it applies this process's sys.path (Python 3.11's
    # forkserver.main takes sys_path and does not use it), skipping what it cannot import: it finds the
    # case modules (and tests/_recompute) through PYTHONPATH, as of its start
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), old) if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 150.0,
    preload: tuple[str, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes joined over gloo.

    ``fn`` must be importable (a module-level function); ``preload`` names modules the fork server
    imports once besides ``_PRELOAD`` (only when this call starts the server: ``start_fork_server``). Returns the per-rank results, rank order.
    Raises:
        RuntimeError: a worker failed (its traceback is in the message) or the world timed out.
    """
    start_fork_server(preload)
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, folder, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()  # only our own children, by handle
            procs[r].join()
        errors = sorted(Path(folder).glob("error*.txt"))
        if errors:
            # a rank that died without a traceback (a signal, a crash in C++) shows only as its exit code
            silent = {
                r: p.exitcode
                for r, p in enumerate(procs)
                if r not in hung and p.exitcode != 0 and not (Path(folder) / f"error{r}.txt").exists()
            }
            died = f"\nranks that died without a traceback (rank: exit code): {silent}" if silent else ""
            raise RuntimeError("worker failed:\n" + "\n".join(e.read_text() for e in errors) + died)
        if hung:
            raise RuntimeError(f"ranks {hung} did not finish within {timeout_s} s")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(Path(folder) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
