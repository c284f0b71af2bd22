"""Speculative rollout with the MTP module trained online (issue 49): does a run with
``rollout.speculative=mtp`` learn like one without, and does the logged acceptance rate rise as the MTP
module trains beside the policy?

    python bench/spec_mtp_learning.py                    # 2 x 200 sync steps of the default config on CPU
    python bench/spec_mtp_learning.py --steps 40 --out-dir /tmp      # a quick look

Runs ``configs/default.yaml`` twice in sync mode (same seed, same SFT warm start, which the second run
reuses through ``init_from``): ``off``, then ``rollout.speculative=mtp`` with ``trainer.mtp_loss_weight``
(default 1.0) and ``rollout.speculative_max_batch`` raised to the whole batch (on CPU speed is not the
question; the default 32 would leave the default config's 256-sequence batches unspeculated). Reads each
run's ``metrics.jsonl``: held-out accuracy at the evals, ``train/mtp_loss``, ``train/mtp_accuracy`` and
``rollout/spec_acceptance_rate`` per step. Writes ``<out-dir>/spec_mtp_learning.json`` (default
``bench/results``) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _run(args, name: str, *overrides: str, init_from: str | None = None) -> tuple[dict, list[dict]]:
    from moerl.api import train

    sets = dict(
        runtime__mode="sync",
        trainer__steps=args.steps,
        eval__every=args.eval_every,
        output_dir=str(args.work_dir / name),
        seed=args.seed,
    )
    if init_from:
        sets["init_from"] = init_from
    for o in overrides:
        key, value = o.split("=", 1)
        sets[key.replace(".", "__")] = value
    summary = train(str(REPO / "configs" / "default.yaml"), **sets)
    run_dir = Path(summary["policy"]).parent
    return summary, _metrics(run_dir)


def _window_mean(values: list[float | None], lo: int, hi: int) -> float | None:
    got = [v for v in values[lo:hi] if v is not None]
    return statistics.fmean(got) if got else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp-loss-weight", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=3, help="rollout.speculative_tokens")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "spec_mtp_runs")
    args = ap.parse_args()
    off_summary, off = _run(args, "off")
    sft = str(Path(off_summary["policy"]).parent / "sft")
    spec_summary, spec = _run(
        args,
        "mtp",
        "rollout.speculative=mtp",
        f"rollout.speculative_tokens={args.tokens}",
        "rollout.speculative_max_batch=4096",
        f"trainer.mtp_loss_weight={args.mtp_loss_weight}",
        init_from=sft if Path(sft).exists() else None,
    )
    rate = [r.get("rollout/spec_acceptance_rate") for r in spec]
    tenth = max(1, len(rate) // 10)
    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "steps": args.steps,
        "speculative_tokens": args.tokens,
        "mtp_loss_weight": args.mtp_loss_weight,
        "off": {
            "start_acc": off_summary.get("start_eval_accuracy"),
            "final_acc": off_summary.get("final_eval_accuracy"),
            "wall_s": off_summary.get("wall_time_s"),
        },
        "mtp": {
            "start_acc": spec_summary.get("start_eval_accuracy"),
            "final_acc": spec_summary.get("final_eval_accuracy"),
            "wall_s": spec_summary.get("wall_time_s"),
            "acceptance_first_tenth": _window_mean(rate, 0, tenth),
            "acceptance_last_tenth": _window_mean(rate, len(rate) - tenth, len(rate)),
            "mtp_accuracy_first": spec[0].get("train/mtp_accuracy") if spec else None,
            "mtp_accuracy_last": spec[-1].get("train/mtp_accuracy") if spec else None,
        },
        "acceptance_by_step": rate,
        "mtp_loss_by_step": [r.get("train/mtp_loss") for r in spec],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "spec_mtp_learning.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    print(f"{'run':6} {'start acc':>9} {'final acc':>9} {'accept first':>12} {'accept last':>11}")
    for name in ("off", "mtp"):
        r = result[name]
        print(
            f"{name:6} {r['start_acc']!s:>9} {r['final_acc']!s:>9} "
            f"{r.get('acceptance_first_tenth')!s:>12} {r.get('acceptance_last_tenth')!s:>11}"
        )
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
