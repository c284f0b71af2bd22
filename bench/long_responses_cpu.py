"""The default run with long responses on CPU (issue 33): memory bounded by the KV budget, not by slots x length.

    python bench/long_responses_cpu.py                     # max_new_tokens 2048, 30 steps, ~3 min on 2 cores
    python bench/long_responses_cpu.py --max-new 512 --steps 4 --out-dir /tmp   # a quick look

Runs ``moerl train`` on ``configs/default.yaml`` (async, the paged KV cache it uses by default) with
``rollout.max_new_tokens=--max-new`` and the model context raised to fit it, everything else as the
default config (``rollout.kv_token_budget`` 8192 tokens, ``rollout.max_slots`` 256). The same sizes with
``rollout.kv_cache=slots`` are first checked at load time: a slot engine reserves each slot's longest
sequence, 256 x (prompt + max_new) tokens, and the run's load-time check refuses it in one line.

Measured from the run: the cache's size (``rollout/kv_blocks_total`` x block size) and its most-used
blocks over the steps, preemptions, the longest response, and the peak resident memory of the run's
processes (the driver and its Ray processes, from /proc every 0.5 s). Writes
``<out-dir>/long_responses_cpu.json`` atomically.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and all its descendants (Linux /proc), bytes."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo += _children(pid)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new", type=int, default=2048, help="rollout.max_new_tokens")
    p.add_argument("--steps", type=int, default=30, help="trainer.steps")
    p.add_argument("--num-eval", type=int, default=64, help="task.num_eval (the start and final evals)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    if args.max_new < 1 or args.steps < 1 or args.num_eval < 1:
        p.error("--max-new, --steps and --num-eval must be >= 1")
    context = args.max_new + 64  # prompts of the default task are < 10 tokens
    sets = [
        f"rollout.max_new_tokens={args.max_new}",
        f"model.max_position_embeddings={context}",
        f"trainer.steps={args.steps}",
        f"task.num_eval={args.num_eval}",
        "eval.every=0",
        "trainer.checkpoint_every=0",
    ]
    cli = [sys.executable, "-m", "moerl.cli", "train", "--config", str(REPO / "configs" / "default.yaml")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    work = Path(tempfile.mkdtemp(prefix="moerl_long_"))
    sets.append(f"output_dir={work}")

    # 1. the slot engine at the same sizes: refused at load time (each slot would hold the longest sequence)
    slots = subprocess.run(
        [*cli, *(a for s in [*sets, "rollout.kv_cache=slots"] for a in ("--set", s))],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    # 2. the paged run, its process tree's resident memory polled
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cli, *(a for s in sets for a in ("--set", s))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    peak, done = [0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            done.wait(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    out, _ = proc.communicate(timeout=7200)
    done.set()
    poller.join()
    wall = time.perf_counter() - t0
    runs = sorted(work.glob("default-*"))
    rows = []
    if runs and (runs[-1] / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (runs[-1] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = (
        json.loads((runs[-1] / "summary.json").read_text())
        if runs and (runs[-1] / "summary.json").exists()
        else {}
    )
    cfg_text = (runs[-1] / "config.yaml").read_text() if runs else ""
    block = next(
        (int(x.split(":")[1]) for x in cfg_text.splitlines() if x.strip().startswith("kv_block_size:")), None
    )
    budget = next(
        (int(x.split(":")[1]) for x in cfg_text.splitlines() if x.strip().startswith("kv_token_budget:")),
        None,
    )
    slots_n = next(
        (int(x.split(":")[1]) for x in cfg_text.splitlines() if x.strip().startswith("max_slots:")), None
    )
    kv_total = max((r.get("rollout/kv_blocks_total") or 0 for r in rows), default=None)
    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([*cli[1:], *(a for s in sets[:-1] for a in ("--set", s))]),
        "rc": proc.returncode,
        "wall_s": wall,
        "status": summary.get("status"),
        "steps": summary.get("steps"),
        "tasks_lost": summary.get("tasks_lost"),
        "tasks_duplicated": summary.get("tasks_duplicated"),
        "start_eval_accuracy": summary.get("start_eval_accuracy"),
        "final_eval_accuracy": summary.get("final_eval_accuracy"),
        "max_new_tokens": args.max_new,
        "kv_token_budget": budget,
        "kv_block_size": block,
        "max_slots": slots_n,
        "slot_engine_would_reserve_tokens": None if slots_n is None else slots_n * context,
        "kv_cache_tokens": None if kv_total is None or block is None else kv_total * block,
        "kv_blocks_total": kv_total,
        "kv_blocks_used_max": max((r.get("rollout/kv_blocks_used") or 0 for r in rows), default=None),
        "kv_preemptions": max((r.get("rollout/kv_preemptions") or 0 for r in rows), default=None),
        "response_len_mean_max_over_steps": max(
            (r.get("rollout/response_len_mean") or 0 for r in rows), default=None
        ),
        "truncated_frac_max_over_steps": max(
            (r.get("rollout/truncated_frac") or 0 for r in rows), default=None
        ),
        "peak_rss_bytes_process_tree": peak[0],
        "slots_run_rc": slots.returncode,
        "slots_run_line": (slots.stderr.strip().splitlines() or [""])[-1][:400],
        "log_tail": out.strip().splitlines()[-5:],
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "long_responses_cpu.json"
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, target)
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
