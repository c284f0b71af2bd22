"""Learning with a rollout worker SIGKILLed every 60 s against learning without kills (issue 50), on CPU.

    python bench/kill_learning_cpu.py                       # the default config, twice: ~7 min on 2 cores
    python bench/kill_learning_cpu.py --steps 300 --out-dir /tmp    # a shorter look

Runs ``moerl train`` on ``configs/default.yaml`` (async, its defaults: ``fleet.keep_partial`` on, progress
snapshots every ``fleet.snapshot_tokens`` tokens) twice with the same seed: once as it is, once with
``chaos.kill_rollout_every_s=--kill-every`` (a rollout worker SIGKILLed at random gaps of 0.5-1.5 x that,
replaced by the fleet). Compares the held-out accuracy at the end (``final_eval_accuracy``; binomial
standard error sqrt(p (1 - p) / task.num_eval), the noise the two may differ by), the exactly-once books
(``tasks_lost``, ``tasks_duplicated``) and the fleet's kill, resume and discard counts. Writes
``<out-dir>/kill_learning_cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import print_table, write_json  # noqa: E402


def _train(out: Path, overrides: list[str]) -> dict:
    """One ``moerl train`` run (this checkout's code: ``python -m moerl.cli``); its summary and seconds."""
    argv = [sys.executable, "-m", "moerl.cli", "train", "--config", str(REPO / "configs" / "default.yaml")]
    for o in [*overrides, f"output_dir={out}"]:
        argv += ["--set", o]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"moerl train failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    return {"seconds": seconds, "summary": summary}


def _row(name: str, run: dict) -> dict:
    s, fleet = run["summary"], run["summary"].get("fleet", {})
    return {
        "run": name,
        "final_eval_accuracy": s.get("final_eval_accuracy"),
        "start_eval_accuracy": s.get("start_eval_accuracy"),
        "tasks_lost": s.get("tasks_lost"),
        "tasks_duplicated": s.get("tasks_duplicated"),
        "killed": fleet.get("killed"),
        "tokens_resumed": fleet.get("rollout/tokens_resumed"),
        "tokens_discarded": fleet.get("rollout/tokens_discarded"),
        "seconds": run["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill-every", type=float, default=60.0, help="chaos.kill_rollout_every_s")
    p.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the config's)")
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
    args = p.parse_args(argv)
    common = ["runtime.mode=async"] + ([f"trainer.steps={args.steps}"] if args.steps else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="kill_learning_") as tmp:
        for name, extra in (("no kills", []), ("kills", [f"chaos.kill_rollout_every_s={args.kill_every}"])):
            rows.append(_row(name, _train(Path(tmp) / name.replace(" ", "_"), [*common, *extra])))
    acc = [r["final_eval_accuracy"] for r in rows]
    n_eval = 500  # configs/default.yaml task.num_eval
    stderr = math.sqrt(max(acc[0] * (1 - acc[0]), 1e-9) / n_eval) if acc[0] is not None else None
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": vars(args),
        "runs": rows,
        "accuracy_difference": None if None in acc else acc[1] - acc[0],
        "binomial_stderr": stderr,
    }
    print_table("learning with kills", list(rows[0]), [list(r.values()) for r in rows])
    print(write_json("kill_learning_cpu", result, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
