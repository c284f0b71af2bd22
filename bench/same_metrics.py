"""Compare two runs' ``metrics.jsonl`` field by field, leaving out what measures time.

A refactor that must not change what a run computes (issue 31: "a sync 300-step run gives metrics identical
to the pre-change commit") is checked with it: every non-timing field of every step must be equal, floats
included (sync runs are bit-reproducible on one machine at one intra-op thread count: run both sides with
the same ``OMP_NUM_THREADS``; 1 and 2 threads round the SFT warm start differently, 0.168 against 0.190).

    OMP_NUM_THREADS=1 moerl train --set runtime.mode=sync --set trainer.steps=300 --set output_dir=DIR

    python3 bench/same_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl

Timing fields: ``wall_s``, ``timing/*``, ``perf/*``, ``fleet/time_to_replace_s`` and the per-worker rates
(``tokens_per_s``, ``groups_per_s``) inside ``rollout/workers``. Exits 1 and prints the first differences
when any other field of RUN_A differs in RUN_B (a field RUN_B lacks included), or when the step lists
differ; fields only RUN_B has (metrics added since) are listed, not counted as differences.
"""

from __future__ import annotations

import json
import sys

TIMING_PREFIXES = ("timing/", "perf/")
TIMING_FIELDS = {"wall_s", "fleet/time_to_replace_s"}
WORKER_RATES = {"tokens_per_s", "groups_per_s"}


def _strip(record: dict) -> dict:
    """The record less its timing fields; the per-worker records (``rollout/workers``) flattened to
    ``rollout/workers/<worker>/<field>`` so that a per-worker field added since counts as new, not as a
    difference."""
    kept = {k: v for k, v in record.items() if k not in TIMING_FIELDS and not k.startswith(TIMING_PREFIXES)}
    workers = kept.pop("rollout/workers", None)
    if isinstance(workers, dict):
        for w, fields in workers.items():
            kept.update({f"rollout/workers/{w}/{k}": v for k, v in fields.items() if k not in WORKER_RATES})
    elif workers is not None:
        kept["rollout/workers"] = workers
    return kept


def differences(a: list[dict], b: list[dict]) -> list[str]:
    """Human-readable differences between two lists of step records (empty: identical)."""
    if len(a) != len(b):
        return [f"{len(a)} records against {len(b)}"]
    out = []
    for ra, rb in zip(a, b, strict=True):
        sa, sb = _strip(ra), _strip(rb)
        for key in sorted(sa):
            if sa.get(key, "<missing>") != sb.get(key, "<missing>"):
                out.append(
                    f"step {ra.get('step')}: {key}: {sa.get(key, '<missing>')!r} != {sb.get(key, '<missing>')!r}"
                )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 bench/same_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl", file=sys.stderr)
        return 2
    runs = [[json.loads(line) for line in open(path)] for path in argv]
    diffs = differences(*runs)
    fields = len(_strip(runs[0][0])) if runs[0] else 0
    if diffs:
        print(f"{len(diffs)} differences; first ones:", *diffs[:20], sep="\n  ")
        return 1
    added = sorted({k for r in runs[1] for k in _strip(r)} - {k for r in runs[0] for k in _strip(r)})
    print(
        f"identical: {len(runs[0])} steps x {fields} non-timing fields"
        + (f"; new in B: {', '.join(added)}" if added else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
