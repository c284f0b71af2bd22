"""Async against sync samples/s on tool-use episodes with a long-tailed number of turns.

    python bench/env_async.py                       # warm start (SFT) once, then a sync and an async run
    python bench/env_async.py --init-from DIR       # reuse a warm-start checkpoint
    python bench/env_async.py --steps 30 --tool-latency-s 0.05 --env-workers 4

The task is ``moerl.envs.calculator`` with 2..8 operands of ``+``/``-`` (P(k operands) ~ 1/(k - 1),
``env.terms_zipf=1``); the warm start always calls the tool once per operator, so an episode takes
k turns (k - 1 tool calls and the answer) and the turns are long-tailed. Every tool call sleeps
``--tool-latency-s`` (a stand-in for a sandbox or a remote tool); ``--env-workers`` workers serve
``--env-concurrency`` calls each at once. Both runs use the same config,
seed, checkpoint and machine; only ``runtime.mode`` differs. The figures are ``samples_per_s`` from
each run's ``summary.json`` (trained samples / seconds of the training loop, whose first step holds
async mode's start-up: Ray, the worker and environment actors) and the same over steps 2..N from
``metrics.jsonl`` (steady state), each as async / sync. Writes ``<out-dir>/env_async.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_json  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.tasks.sft import run_sft  # noqa: E402
from moerl.train import train  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "env_calculator.yaml"


def overrides(args, out: str) -> list[str]:
    """The long-tailed tool-use config shared by both runs."""
    return [
        f"output_dir={out}",
        "env.ops=+-",
        "env.min_terms=2",
        "env.max_terms=8",
        "env.terms_zipf=1.0",
        "env.max_turns=10",
        "env.max_tokens=160",
        "env.demo_tool_frac=1.0",
        f"env.step_latency_s={args.tool_latency_s}",
        f"env.num_workers={args.env_workers}",
        f"env.max_pending_per_worker={args.env_concurrency}",
        "model.max_position_embeddings=192",
        "rollout.max_new_tokens=12",
        "rollout.max_slots=64",
        "rollout.kv_token_budget=12288",
        f"trainer.steps={args.steps}",
        "trainer.batch_groups=8",
        "trainer.lr=1.0e-4",
        "task.num_eval=20",
        "eval.every=0",
        "sft.steps=300",
    ]


def run_figures(work: Path, mode: str) -> dict:
    """Figures of the finished ``bench-<mode>`` run in ``work`` (its summary.json and metrics.jsonl)."""
    (folder,) = work.glob(f"bench-{mode}-*")
    s = json.loads((folder / "summary.json").read_text())
    recs = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steady_s = recs[-1]["wall_s"] - recs[0]["wall_s"]  # steps 2..N: no start-up (Ray, actors, first lease)
    env = s["env"]
    return {
        "samples_per_s": s["samples_per_s"],
        "steady_samples_per_s": s["samples_trained"] * (len(recs) - 1) / len(recs) / steady_s,
        "wall_time_s": s["wall_time_s"],
        "samples_trained": s["samples_trained"],
        "turns_per_episode": env["turns_per_episode"],
        "latency_p50_s": env["latency_p50_s"],
        "latency_p99_s": env["latency_p99_s"],
        "parked_max": env["parked_max"],
        "tasks_requeued": s["tasks_requeued"],
        "tasks_duplicated": s["tasks_duplicated"],
        "tasks_lost": s["tasks_lost"],
    }


def report(runs: dict, payload: dict, out_dir: str | None) -> None:
    """Print the table and write ``env_async.json``."""
    ratio = runs["async"]["samples_per_s"] / runs["sync"]["samples_per_s"]
    steady = runs["async"]["steady_samples_per_s"] / runs["sync"]["steady_samples_per_s"]
    rows = [
        [
            mode,
            f"{r['samples_per_s']:.1f}",
            f"{r['steady_samples_per_s']:.1f}",
            f"{r['wall_time_s']:.1f}",
            f"{r['turns_per_episode']:.2f}",
            f"{1e3 * r['latency_p50_s']:.1f}",
            f"{1e3 * r['latency_p99_s']:.1f}",
            r["parked_max"],
        ]
        for mode, r in runs.items()
    ]
    print_table(
        f"tool-use episodes, long-tailed turns: async/sync samples/s = {ratio:.2f} (whole loop), "
        f"{steady:.2f} (steps 2..N)",
        [
            "mode",
            "samples/s",
            "steps 2..N",
            "loop s",
            "turns/episode",
            "env p50 ms",
            "env p99 ms",
            "parked max",
        ],
        rows,
    )
    payload = {**payload, "runs": runs, "async_over_sync": ratio, "async_over_sync_steady": steady}
    print(f"wrote {write_json('env_async', payload, out_dir)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init-from", default=None, help="warm-start checkpoint (default: SFT one first)")
    p.add_argument("--steps", type=int, default=20, help="trainer steps of each run")
    p.add_argument("--tool-latency-s", type=float, default=0.1, help="seconds each tool call sleeps")
    p.add_argument("--env-workers", type=int, default=2, help="environment workers per rollout worker")
    p.add_argument(
        "--env-concurrency", type=int, default=32, help="calls each environment worker serves at once"
    )
    p.add_argument("--out-dir", default=None, help="folder of env_async.json (default bench/results)")
    p.add_argument("--report-only", default=None, help="a finished bench folder: only read its two runs")
    args = p.parse_args()
    work = Path(args.report_only or tempfile.mkdtemp(prefix="env_async-"))
    base = overrides(args, str(work))
    init = args.init_from
    if args.report_only is None:
        if init is None:
            init = str(run_sft(load_config(CONFIG, base), out_dir=work / "sft"))
        for mode in ("sync", "async"):
            cfg = load_config(
                CONFIG, [*base, f"init_from={init}", f"runtime.mode={mode}", f"name=bench-{mode}"]
            )
            train(cfg, live=False)
    runs = {mode: run_figures(work, mode) for mode in ("sync", "async")}
    report(runs, {"config": str(CONFIG), "overrides": base, "init_from": init}, args.out_dir)


if __name__ == "__main__":
    main()
