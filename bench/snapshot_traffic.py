"""Progress-snapshot traffic at the exchange and its cost to decode speed, on CPU (issue 50).

    python bench/snapshot_traffic.py                          # 512-token responses, ~2 min on 2 cores
    python bench/snapshot_traffic.py --rounds 1 --steps 40 --out-dir /tmp    # a quick look

One ``RolloutWorker`` of the default config's model (``configs/default.yaml``, fresh weights, its context
raised to fit) decodes ``--max-new``-token responses (no stop token: every response runs to its end) in
``--slots`` slots over a local task queue and buffer, as a rollout worker does. Rounds alternate between
the worker alone and the worker with its ``SnapshotSender`` (``fleet.snapshot_tokens`` = ``--every``,
``fleet.snapshot_poll_s`` = ``--poll-s``) sending to the queue's ``save_progress`` through a pickle round
trip (what a Ray call to the exchange serializes). Each round runs ``--steps`` scheduler steps.

Measured: decode tokens/s of each round (response tokens generated, delivered or in flight, per second of
the round's steps), the median over the rounds of each kind and their ratio (on a shared, loaded machine
this wall-clock ratio is noisy: rounds of one kind spread by 2x); therefore also the CPU seconds, which
other processes do not change: the decode thread's (``time.thread_time``) per token in each kind of round,
and the snapshot thread's (``SnapshotStats.cpu_s``), whose ratio to the decode thread's CPU bounds what
the snapshots can take from decode (the GIL: at most the time the snapshot thread runs Python).
``decode_cost_cpu_frac`` = (decode CPU per token with snapshots + snapshot CPU per token) / decode CPU
per token alone - 1 (decode CPU per token: the median over the rounds of each kind). The sender's bytes/s (pickled batches), snapshots and calls per second, per worker.
Writes ``<out-dir>/snapshot_traffic.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.models import build_model  # noqa: E402
from moerl.runtime.buffer import ExperienceBuffer  # noqa: E402
from moerl.runtime.build import make_engine, make_queue  # noqa: E402
from moerl.runtime.snapshots import SnapshotSender  # noqa: E402
from moerl.runtime.worker import RolloutWorker  # noqa: E402
from moerl.tasks import make_task  # noqa: E402
from moerl.tasks.tokenizer import load_run_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _worker(args) -> RolloutWorker:
    over = [
        f"rollout.max_new_tokens={args.max_new}",
        f"rollout.max_slots={args.slots}",
        f"rollout.kv_token_budget={args.slots * (args.max_new + 32)}",
        f"model.max_position_embeddings={args.max_new + 64}",
        "rollout.lease_ahead_groups=0",
    ]
    cfg = load_config(REPO / "configs" / "default.yaml", over)
    torch.manual_seed(0)
    tok = load_run_tokenizer(cfg, None)
    model = build_model(cfg.model, tok.vocab_size).eval()
    task = make_task(cfg.task, cfg.env, tok)
    queue = make_queue(cfg, task, tok)
    buffer = ExperienceBuffer(1 << 20, max_staleness=1 << 20, settle=queue.settle, requeue=queue.requeue)
    engine = make_engine(model, cfg)
    worker = RolloutWorker(
        "bench", engine, task, tok.decode, queue, buffer, cfg.rollout, stop_token_ids=(), run_seed=0
    )
    return worker


def _tokens(worker: RolloutWorker) -> int:
    return worker.stats.tokens_generated + sum(g.num_tokens for g in worker.in_flight())


def _round(worker: RolloutWorker, steps: int, sender: SnapshotSender | None) -> dict:
    before, s = _tokens(worker), sender.stats if sender is not None else None
    sent_before = None if s is None else (s.bytes_sent, s.sends, s.snapshots, s.cpu_s)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        worker.step()
    dt, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if sender is not None:
        sender.close()  # its last look is counted
    out = {"seconds": dt, "tokens": _tokens(worker) - before, "decode_cpu_s": cpu}
    out["tokens_per_s"] = out["tokens"] / dt
    out["decode_cpu_s_per_token"] = cpu / out["tokens"]
    if s is not None:
        out["bytes_per_s"] = (s.bytes_sent - sent_before[0]) / dt
        out["sends_per_s"] = (s.sends - sent_before[1]) / dt
        out["snapshots_per_s"] = (s.snapshots - sent_before[2]) / dt
        out["snapshot_cpu_s"] = s.cpu_s - sent_before[3]
    return out


def run(args) -> dict:
    torch.set_num_threads(1)
    worker = _worker(args)

    def sink(batch):  # what a Ray call to the exchange does: serialize, deserialize, save
        return worker.queue.save_progress(pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))

    _round(worker, args.warmup, None)  # the engine full of sequences at mixed progress
    plain, snap = [], []
    for _ in range(args.rounds):
        plain.append(_round(worker, args.steps, None))
        sender = SnapshotSender("bench", worker.in_flight, sink, every_tokens=args.every, poll_s=args.poll_s)
        sender.start()
        snap.append(_round(worker, args.steps, sender))
    base = statistics.median(r["tokens_per_s"] for r in plain)
    with_snap = statistics.median(r["tokens_per_s"] for r in snap)
    # medians over rounds: one round slowed by a neighbour's burst (cache, memory bandwidth) moves a
    # thread's CPU time per token too, by up to 1.5x on the shared machine
    cpu_plain = statistics.median(r["decode_cpu_s_per_token"] for r in plain)
    cpu_decode_snap = statistics.median(r["decode_cpu_s_per_token"] for r in snap)
    cpu_sender = sum(r["snapshot_cpu_s"] for r in snap) / sum(r["tokens"] for r in snap)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "torch": torch.__version__,
        "config": vars(args),
        "decode_tokens_per_s_plain": base,
        "decode_tokens_per_s_snapshots": with_snap,
        "decode_cost_frac": 1.0 - with_snap / base,
        "decode_tokens_per_s_spread_plain": [
            min(r["tokens_per_s"] for r in plain),
            max(r["tokens_per_s"] for r in plain),
        ],
        "decode_cpu_us_per_token_plain": 1e6 * cpu_plain,
        "decode_cpu_us_per_token_snapshots": 1e6 * cpu_decode_snap,
        "snapshot_cpu_us_per_token": 1e6 * cpu_sender,
        "decode_cost_cpu_frac": (cpu_decode_snap + cpu_sender) / cpu_plain - 1.0,
        "snapshot_cpu_frac_of_decode": cpu_sender / cpu_decode_snap,
        "snapshot_bytes_per_s_per_worker": statistics.median(r["bytes_per_s"] for r in snap),
        "snapshot_calls_per_s_per_worker": statistics.median(r["sends_per_s"] for r in snap),
        "group_snapshots_per_s_per_worker": statistics.median(r["snapshots_per_s"] for r in snap),
        "rounds_plain": plain,
        "rounds_snapshots": snap,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new", type=int, default=512, help="response tokens (rollout.max_new_tokens)")
    p.add_argument("--slots", type=int, default=32, help="rollout.max_slots (4 groups of 8)")
    p.add_argument("--every", type=int, default=64, help="fleet.snapshot_tokens")
    p.add_argument("--poll-s", type=float, default=0.25, help="fleet.snapshot_poll_s")
    p.add_argument("--steps", type=int, default=150, help="scheduler steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each kind, alternating")
    p.add_argument("--warmup", type=int, default=100, help="scheduler steps before the first round")
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
    args = p.parse_args(argv)
    result = run(args)
    rows = [
        ["decode tok/s, worker alone", result["decode_tokens_per_s_plain"]],
        ["decode tok/s, with snapshots", result["decode_tokens_per_s_snapshots"]],
        ["decode cost, wall clock (1 - ratio)", result["decode_cost_frac"]],
        ["decode CPU us/token alone", result["decode_cpu_us_per_token_plain"]],
        ["decode CPU us/token with snapshots", result["decode_cpu_us_per_token_snapshots"]],
        ["snapshot thread CPU us/token", result["snapshot_cpu_us_per_token"]],
        ["decode cost, CPU time", result["decode_cost_cpu_frac"]],
        ["snapshot bytes/s per worker", result["snapshot_bytes_per_s_per_worker"]],
        ["snapshot calls/s per worker", result["snapshot_calls_per_s_per_worker"]],
    ]
    print_table(
        f"snapshot traffic (every {args.every} tokens, {args.max_new}-token responses)", ["", ""], rows
    )
    print(write_json("snapshot_traffic", result, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
