"""How much faster async can be than sync on this machine's cores: the bound set by 1-thread work.

    python bench/async_bound.py                                   # default config, fresh policy
    python bench/async_bound.py --init-from runs/<run>/sft        # the main job's warm-start checkpoint

On C cores, sync mode runs generation and then training, each with C torch threads, so one step takes
``G_C + T_C + P`` (generate a batch, train on it, publish). Async mode (``runtime.mode=async``, local
Ray) runs the rollout worker and the trainer side by side, each with ``C / 2`` threads on 2 cores, so
even with perfect overlap and no Ray overhead a step takes at least ``max(G_1, T_1 + P)``. The ratio
``(G_2 + T_2 + P) / max(G_1, T_1 + P)`` is therefore an upper bound on async/sync samples/s for 2
cores. The timings alternate between 1 and 2 threads batch by batch in one process, so that the
machine's drift (large on shared VMs) hits both thread counts alike.

The bound assumes that the two processes do not slow each other down. The second part measures that:
a helper process generates batches at 1 thread in a loop, switched on and off, while this process
times 1-thread train steps; ``T1 beside generation / T1 alone`` is the slowdown the trainer suffers
from sharing the machine with a rollout worker (caches, memory bandwidth, and on a VM the host's
placement of its virtual CPUs), and ``async_over_sync_bound_shared`` redoes the bound with it.

Writes ``<out-dir>/async_bound.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_json  # noqa: E402
from moerl.allocator import keep_freed_memory  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.runtime.build import build_components  # noqa: E402
from moerl.runtime.local import LocalRollouts  # noqa: E402
from moerl.trainer.local import LocalTrainer  # noqa: E402
from moerl.weights.store import WeightStore  # noqa: E402


def _sync_parts(
    config: str | None, overrides: list[str], init_from: str | None, store_dir: str, seed_offset=0
):
    """The sync-mode run config, components (policy, tokenizer, store in ``store_dir``) and fleet, as
    ``moerl train --set runtime.mode=sync`` builds them."""
    keep_freed_memory()  # as the CLI and the actors do
    cfg = load_config(config, ["runtime.mode=sync", *overrides])
    torch.manual_seed(cfg.seed + seed_offset)
    comp = build_components(cfg, init_from, WeightStore(store_dir, keep=2))
    return cfg, comp, LocalRollouts.start(cfg, comp, 0, None)


def measure(config: str | None, overrides: list[str], init_from: str | None, rounds: int) -> dict:
    """Median seconds of one batch's generation (G), train step (T) at 1 and 2 threads, and publish (P)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, comp, fleet = _sync_parts(config, overrides, init_from, tmp)
        trainer = LocalTrainer.from_run_config(comp.model, cfg)
        times: dict[str, list[float]] = {"G1": [], "G2": [], "T1": [], "T2": [], "P": []}
        for i in range(2 * rounds + 2):  # the first two (one per thread count) are warm-up
            threads = 1 + i % 2
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            groups, _, _ = fleet.next_groups(cfg.trainer.batch_groups)
            t1 = time.perf_counter()
            trainer.train_step(trainer.build_batch(groups, comp.tokenizer.pad_id))
            t2 = time.perf_counter()
            fleet.publish(trainer)  # written to the store, handed to the worker in process
            t3 = time.perf_counter()
            if i >= 2:
                times[f"G{threads}"].append(t1 - t0)
                times[f"T{threads}"].append(t2 - t1)
                times["P"].append(t3 - t2)
        fleet.close()
    return {k: statistics.median(v) for k, v in times.items()}


def _generate_forever(config, overrides, init_from, is_on, is_ready) -> None:
    """Helper process: generate batches at 1 thread while ``is_on`` is set (a stand-in rollout worker)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _, fleet = _sync_parts(config, overrides, init_from, tmp, seed_offset=1)
        fleet.next_groups(cfg.trainer.batch_groups)  # warm-up
        is_ready.set()
        while True:
            is_on.wait()
            fleet.next_groups(cfg.trainer.batch_groups)


def measure_sharing(config: str | None, overrides: list[str], init_from: str | None, rounds: int) -> dict:
    """Median seconds of a 1-thread train step alone and beside a 1-thread generation loop, alternating."""
    import multiprocessing as mp

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    is_on, is_ready = ctx.Event(), ctx.Event()
    helper = ctx.Process(
        target=_generate_forever, args=(config, overrides, init_from, is_on, is_ready), daemon=True
    )
    helper.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg, comp, fleet = _sync_parts(config, overrides, init_from, tmp)
            trainer = LocalTrainer.from_run_config(comp.model, cfg)
            batches = [
                trainer.build_batch(fleet.next_groups(cfg.trainer.batch_groups)[0], comp.tokenizer.pad_id)
                for _ in range(4)
            ]
            if not is_ready.wait(timeout=300):
                raise RuntimeError("the generation helper process did not start within 300 s")
            times: dict[str, list[float]] = {"alone": [], "beside_generation": []}
            for i in range(2 * rounds + 2):
                is_beside = i % 2 == 1
                (is_on.set if is_beside else is_on.clear)()
                time.sleep(0.2)  # the helper finishes its batch / starts its loop
                t0 = time.perf_counter()
                trainer.train_step(batches[i % len(batches)])
                if i >= 2:
                    times["beside_generation" if is_beside else "alone"].append(time.perf_counter() - t0)
    finally:
        helper.kill()
        helper.join()
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--init-from", default=None, help="HF checkpoint folder of the policy (default: fresh)")
    p.add_argument("--rounds", type=int, default=20, help="batches timed per thread count")
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        m = measure(args.config, args.overrides, args.init_from, args.rounds)
        shared = measure_sharing(args.config, args.overrides, args.init_from, args.rounds)
    finally:
        torch.set_num_threads(threads)
    slowdown = shared["beside_generation"] / shared["alone"]
    sync_step = m["G2"] + m["T2"] + m["P"]
    async_floor = max(m["G1"], m["T1"] + m["P"])
    async_floor_shared = max(m["G1"] * slowdown, m["T1"] * slowdown + m["P"])
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "init_from": args.init_from,
        "rounds": args.rounds,
        "median_s": m,
        "sync_step_s": sync_step,
        "async_step_floor_s": async_floor,
        "async_over_sync_bound": sync_step / async_floor,
        "thread_speedup": {"generate": m["G1"] / m["G2"], "train": m["T1"] / m["T2"]},
        "train_1_thread_s": shared,
        "sharing_slowdown": slowdown,
        "async_over_sync_bound_shared": sync_step / async_floor_shared,
    }
    print(f"{'':10s} {'1 thread':>10s} {'2 threads':>10s}")
    for name, key in (("generate", "G"), ("train", "T")):
        print(f"{name:10s} {m[key + '1'] * 1e3:8.1f}ms {m[key + '2'] * 1e3:8.1f}ms")
    print(f"publish    {m['P'] * 1e3:8.1f}ms")
    print(
        f"sync step G2+T2+P = {sync_step * 1e3:.1f} ms; async floor max(G1, T1+P) = {async_floor * 1e3:.1f} ms; "
        f"async/sync samples/s at most {result['async_over_sync_bound']:.2f}x"
    )
    print(
        f"train step at 1 thread: {shared['alone'] * 1e3:.1f} ms alone, {shared['beside_generation'] * 1e3:.1f} ms "
        f"beside a generating process ({slowdown:.2f}x); with that slowdown on both sides async/sync is at most "
        f"{result['async_over_sync_bound_shared']:.2f}x"
    )
    write_json("async_bound", result, args.out_dir)
    return result


if __name__ == "__main__":
    main()
