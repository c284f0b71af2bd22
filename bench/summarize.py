"""The headline figures of the one-GPU benchmarks against the issue's targets, from their JSON files.

    python bench/summarize.py [FOLDER] [--markdown]     # FOLDER default bench/results

Reads moe_layer.json, rollout_gpu.json, train_step.json and ep_smoke.json where present; prints one row
per target (plain text, or a Markdown table for bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _logit_detail(lg: dict) -> str:
    if "fast_vs_float32" not in lg:
        return "rel. error"
    detail = (
        f"vs float32 copy: fast {lg['fast_vs_float32']:.1e}, reference {lg['reference_vs_float32']:.1e}, "
        f"transformers {lg['transformers_vs_float32']:.1e}"
    )
    if "fast_vs_reference_same_routing" in lg:
        detail = (
            f"free routing {lg['fast_vs_reference']:.1e} ({100 * lg['routing_flip_frac']:.1f}% of expert "
            f"choices differ); {detail}"
        )
    return detail


def _rollout_rows(r: dict) -> list[list[str]]:
    res, f, a = r["results"], r["floor"], r["agreement"]
    m = res["moerl"]
    rows = [
        [
            f"decode B={r['batch']} {r['prompt_len']}+{r['new_tokens']} ({r['spec']['name']})",
            f"moerl {m['tokens_per_s']:.0f} tok/s"
            + (
                f", transformers {res['transformers']['tokens_per_s']:.0f} tok/s"
                if "transformers" in res
                else ""
            ),
            f"{res['speedup']:.1f}x" if "speedup" in res else "-",
            ">= 20x",
        ],
        [
            "decode vs bandwidth floor",
            f"floor {f['tokens_per_s']:.0f} tok/s (decode-only of floor {(f['of_floor_decode'] or 0):.2f})",
            f"{f['of_floor_total']:.2f}",
            "report (goal 0.5)",
        ],
        [
            "logits fast vs reference path (bf16)",
            _logit_detail(a["logits"]),
            f"{a['logits'].get('fast_vs_reference_same_routing', a['logits']['fast_vs_reference']):.2e}"
            + (" (same routing)" if "fast_vs_reference_same_routing" in a["logits"] else ""),
            "< 1e-2",
        ],
    ]
    lp = a["engine_vs_trainer_logprobs"]
    rows.append(
        [
            "engine vs trainer log-probs",
            f"mean abs diff over {lp['tokens']} tokens (max {lp['max_abs_diff']:.3f})",
            f"{lp['mean_abs_diff']:.4f}",
            "< 0.02 nats",
        ]
    )
    return rows


def _moe_rows(r: dict) -> list[list[str]]:
    res = r["results"]
    m = res["moerl"]["fwd_bwd"]
    t = res.get("transformers", {}).get("fwd_bwd")
    return [
        [
            f"MoE layer {r['tokens']} tokens fwd+bwd",
            f"moerl {m['median_ms']:.1f} ms ({m['tflop_s']:.0f} TFLOP/s, "
            f"{m['of_peak']:.0%} of peak)" + (f", transformers {t['median_ms']:.1f} ms" if t else ""),
            f"{m['vs_transformers']:.2f}x" if t else "-",
            ">= 1x",
        ]
    ]


def _train_rows(r: dict) -> list[list[str]]:
    rows = []
    for name, v in r["results"].items():
        if "error" in v:
            rows.append([f"train step {name} seq {r['seq_len']}", v["error"][:60], "-", "MFU >= 0.35"])
        else:
            rows.append(
                [
                    f"train step {name} seq {r['seq_len']}",
                    f"{v['tokens_per_s']:.0f} tok/s, {v['peak_memory_gib'] or 0:.0f} GiB",
                    f"MFU {v['mfu']:.2f}",
                    "MFU >= 0.35",
                ]
            )
    return rows


def _ep_rows(r: dict) -> list[list[str]]:
    return [
        [
            f"EP {k} world size 1 ({r['backend']})",
            f"disp+comb {v['dispatch_combine_ms']:.2f} ms",
            f"rel err {v['out_rel_err']:.1e}",
            "agrees",
        ]
        for k, v in r["results"].items()
    ]


def summary_rows(folder: Path) -> list[list[str]]:
    """One row per figure: what, measured, ratio or value, target."""
    rows = []
    for name, fn in (
        ("rollout_gpu", _rollout_rows),
        ("moe_layer", _moe_rows),
        ("train_step", _train_rows),
        ("ep_smoke", _ep_rows),
    ):
        r = _load(folder, name)
        if r is not None:
            try:
                rows += fn(r)
            except (KeyError, TypeError) as e:
                rows.append([name, f"incomplete result ({e!r})", "-", "-"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    rows = summary_rows(folder)
    header = ["figure", "measured", "value", "target"]
    ceil = next(
        (r["ceilings"] for n in ("rollout_gpu", "moe_layer", "train_step") if (r := _load(folder, n))), None
    )
    if a.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        for r in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    if ceil:
        print(
            f"ceilings: copy {ceil['copy_tb_s']:.2f} TB/s, bf16 matmul {ceil['matmul_tflop_s']:.0f} TFLOP/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
