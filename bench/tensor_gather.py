"""Per-tensor cost of gathering a sharded policy tensor by tensor: moerl's own ``iter_full_tensors``.

    python bench/tensor_gather.py                     # gloo on this host, 2,000 tiny tensors, 1 and 2 ranks

A trainer that holds its policy FSDP2-sharded and sends full tensors (moerl's sharded publish and
object-store stream, verl's checkpoint engine, NeMo-RL's packed broadcast of the non-FFN weights) pays,
per tensor, the ``DTensor.full_tensor()`` dispatch, one all-gather collective and the Python of the loop,
whatever the tensor's bytes. This bench isolates that cost: ``--tensors`` tensors of ``--rows`` x
``--cols`` fp32 (16 KiB: bytes negligible), the parameters of one ``fully_shard``-ed module over a gloo
mesh, gathered by ``moerl.trainer.distributed.publish.iter_full_tensors`` (the function the sharded
publish uses), against the bare collective (``dist.all_gather_single`` of the same shards, no DTensor) and
an empty loop. For each it records rank 0's wall and CPU (``time.process_time``) seconds per tensor,
median over ``--rounds`` rounds, on a mesh of 1 rank and of 2 ranks.

The planner's ``tensor_s`` (``moerl.plan.transports.sync_constants``) is the 1-rank run's CPU seconds per
tensor of ``iter_full_tensors``: the host work a rank does per tensor (DTensor dispatch, the collective's
call, the loop) without gloo's TCP transport, which a GPU trainer does not use (its NCCL collective runs
on the GPU, asynchronously to the host). CPU rather than wall seconds, because this host is shared: wall
time holds the waits for other processes' CPU. The 2-rank run is recorded beside it as a reference
(gloo's transport on CPU included).

Writes ``<out-dir>/tensor_gather_cpu.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, print_table, write_json  # noqa: E402


def _timed(fn) -> tuple[float, float]:
    """(wall s, CPU s of this process) of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _rank(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moerl.trainer.distributed.publish import iter_full_tensors

    mesh = init_device_mesh("cpu", (args.world,))
    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(args.rows, args.cols)) for _ in range(args.tensors)]
    )
    fully_shard(model, mesh=mesh)
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    outs = [torch.empty(args.rows, args.cols) for _ in shards]

    def moerl_path() -> None:
        for _ in iter_full_tensors(model):
            pass

    def bare_collective() -> None:
        for s, o in zip(shards, outs, strict=True):
            dist.all_gather_single(o, s)

    def empty_loop() -> None:
        for _ in range(args.tensors):
            pass

    paths = {"iter_full_tensors": moerl_path, "all_gather_single": bare_collective, "empty_loop": empty_loop}
    res = {}
    for name, fn in paths.items():
        fn()  # warm-up
        rounds = []
        for _ in range(args.rounds):
            dist.barrier()
            rounds.append(_timed(fn))
        res[name] = {"wall_s_per_tensor": statistics.median(w for w, _ in rounds) / args.tensors,
                     "cpu_s_per_tensor": statistics.median(c for _, c in rounds) / args.tensors,
                     "rounds": [[w, c] for w, c in rounds]}  # fmt: skip
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def out_items(res: dict, world: int) -> list[tuple[str, dict]]:
    """(path, its record) of the ``world``-rank run."""
    return list(res[f"world_{world}"].items())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.tensors < 1 or args.rounds < 1 or args.rows < 2 or args.rows % 2 or args.cols < 1:
        p.error("--tensors, --rounds, --cols must be >= 1 and --rows even (two shards)")
    res, rows = {}, []
    for world in (1, 2):
        args.world = world
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(args, args.port + world, out), nprocs=world, join=True)
            res[f"world_{world}"] = dict(out)
        rows += [
            [world, k, 1e6 * v["wall_s_per_tensor"], 1e6 * v["cpu_s_per_tensor"]]
            for k, v in out_items(res, world)
        ]
    record = {"benchmark": "tensor_gather", "device": device_info(torch.device("cpu")), "backend": "gloo",
              "tensors": args.tensors, "shape": [args.rows, args.cols], "dtype": "float32",
              "rounds": args.rounds, "host_cpus": os.cpu_count(), "load_average_1_5_15": list(os.getloadavg()),
              "results": res}  # fmt: skip
    print_table("tensor_gather (gloo, rank 0)", ["ranks", "path", "wall us/tensor", "cpu us/tensor"], rows)
    write_json("tensor_gather_cpu", record, args.out_dir)
    return record


if __name__ == "__main__":
    main()
