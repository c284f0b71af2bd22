"""End-to-end benchmark of `moerl train` on one GPU (issue 32): real runs against their parts alone.

For each model size (``--sizes``) in one call:
1. **alone** (a child process, ``--alone``): the run's own config, policy, engine and trainer, built as a
   run builds them (``moerl.runtime.build``, ``LocalRollouts``, ``make_trainer``) on the same GPU; the
   rollout side generates ``--alone-steps`` batches with no trainer present (engine alone), then the
   trainer trains on those batches with no generation (trainer alone). It saves the policy as a Hugging
   Face folder, which every run of that size starts from (``init_from``: no SFT warm start).
2. **runs** (``--modes``): ``python3 -m moerl.cli train`` subprocesses, sync and async, on GSM8K prompts.
   Per step from the run's ``metrics.jsonl``: generation, training, weight handoff (``timing/publish_s``;
   async also ``timing/weight_sync_s`` and the worker side), waiting, eval (``timing/eval_s``), step
   time, rollout and training tokens/s; the time from the command to the first RL step (its console
   line); the GPU's peak memory (nvidia-smi, every 0.5 s, all processes); and every line of the run log
   matching "capture failed" (a CUDA graph that fell back to eager decoding).

Ratios (from one call, the GPU being shared and noisy): in-run rollout tokens/s over the engine alone,
in-run training tokens/s over the trainer alone, async step time over (generation alone + training
alone). Medians over the steady steps: after the first (which captures CUDA graphs and warms the
allocator), not the last (the run's final save, ``timing/final_save_s``), without a held-out eval (the
parts alone do neither); the step-time ratio over every step after the first is given beside it.

Prompts: the first 512 GSM8K test problems (bench/data, MIT licence, OpenAI), tokenized by moerl's bundled
BPE tokenizer (99 tokens, about one per character: prompts of ~100-630 tokens); responses sampled at
temperature 1 up to ``max_new_tokens`` (256 on the GPU) from a randomly initialized policy, so their lengths
follow its end-of-sequence draws (the JSON states the measured quantiles and the truncated fraction).
Sizes (the vocabulary is the tokenizer's 99, so the embedding and lm_head are small):
  1b    hidden 1024, 8 layers, 8 heads x 128, 64 experts top-8 of width 512, bf16 (~0.86 B parameters)
  6.9b  the benchmarks' ``reference`` shape: hidden 2048, 16 layers, 16 heads x 128, 64 experts top-8 of
        width 1024, bf16 (~6.7 B parameters with this vocabulary)
  tiny  a CPU smoke size (``--tiny``: every step of the script on CPU in a few minutes)

    python3 bench/e2e_gpu.py --device cuda --sizes 1b --modes sync        # a subset fits a 10-min call
    source .ray/activate; python3 bench/e2e_gpu.py --device cuda --out-dir $OUT   # all (async needs Ray)
    python3 bench/e2e_gpu.py --tiny                                       # CPU smoke run

Results: ``<out-dir>/e2e_gpu_<UTC date>.json`` (entries of one size and mode replace older ones of the
same day, so several calls fill one file), run logs under ``--work-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from moerl.atomic import atomic_write_text
from moerl.plan.models import MODELS, ModelShape

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "bench" / "data" / "gsm8k_test_512.jsonl"
CAPTURE_FAILED = re.compile(r"capture failed", re.IGNORECASE)
FIRST_STEP = re.compile(r"\bstep 1/\d+")

# name -> (model section, rollout / trainer / task sizes)


def _shape_fields(shape: ModelShape) -> dict:
    """``model.*`` fields of a planner preset (``moerl.plan.models.MODELS``: the one table of sizes)."""
    return dict(
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads or shape.num_heads,  # 0: as many as query heads
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        moe_intermediate_size=shape.moe_intermediate_size,
    )


SIZES: dict[str, dict] = {
    "tiny": {
        "model": dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            head_dim=16,
            num_experts=8,
            top_k=2,
            moe_intermediate_size=64,
            dtype="float32",
        ),
        "max_new_tokens": 8,
        "group_size": 2,
        "batch_groups": 2,
        "micro_batch_size": 4,
        "kv_token_budget": 8192,
        "num_eval": 4,
        "sync_every": 1,
    },
    "1b": {
        "model": dict(
            hidden_size=1024,
            num_layers=8,
            num_heads=8,
            num_kv_heads=8,
            head_dim=128,
            num_experts=64,
            top_k=8,
            moe_intermediate_size=512,
            dtype="bfloat16",
        ),
        "max_new_tokens": 256,
        "group_size": 8,
        "batch_groups": 32,
        "micro_batch_size": 32,
        "kv_token_budget": 98304,
        "num_eval": 64,
        "sync_every": 8,
    },
    "6.9b": {
        "model": {**_shape_fields(MODELS["reference"]), "dtype": "bfloat16"},  # the benchmarks' 6.9 B
        "max_new_tokens": 256,
        "group_size": 8,
        "batch_groups": 32,
        "micro_batch_size": 16,
        "kv_token_budget": 98304,
        "num_eval": 64,
        "sync_every": 8,
    },
}
STEP_FIELDS = (
    "timing/gen_s",
    "timing/train_s",
    "timing/publish_s",
    "timing/wait_s",
    "timing/eval_s",
    "timing/final_save_s",
    "perf/step_time_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "timing/weight_sync_s",
    "timing/weight_sync_worker_s",
    "rollout/response_len_mean",
    "rollout/truncated_frac",
    "rollout/reward_mean",
    "eval/accuracy",
)


def run_config(size: str, device: str, work: Path, steps: int, eval_every: int) -> dict:
    """The run config (a YAML-compatible dict) of one size; the mode and init_from are set per run."""
    s = SIZES[size]
    return {
        "name": f"e2e-{size}",
        "seed": 0,
        "output_dir": str(work / "runs"),
        "model": {"family": "qwen3_moe", **s["model"], "max_position_embeddings": 1024, "device": device},
        "task": {"name": "jsonl", "path": str(DATA), "layout": "gsm8k", "num_eval": s["num_eval"]},
        "rollout": {
            "num_workers": 1,
            "group_size": s["group_size"],
            "max_new_tokens": s["max_new_tokens"],
            "temperature": 1.0,
            "max_slots": s["group_size"] * s["batch_groups"],
            "kv_token_budget": s["kv_token_budget"],
            "max_prefill_tokens": 16384,
            "sync_every": s["sync_every"],
        },
        "trainer": {
            "steps": steps,
            "batch_groups": s["batch_groups"],
            "micro_batch_size": s["micro_batch_size"],
            "lr": 1.0e-6,
            "publish_every": 1,
            "checkpoint_every": 0,
        },
        # the store (serialized versions) only at version 0 and the last: the hand-over is in process (sync)
        # or through runtime.weight_sync (async), never through files on the step's path
        "runtime": {
            "buffer_groups": 2 * s["batch_groups"],
            "max_staleness": 1,
            "durable_every": 1000000,
            "overlap_publish": True,
        },
        "eval": {"every": eval_every},
        "sft": {"steps": 1},
    }


def _quantiles(xs: list[int]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "p10": q(0.1),
        "p50": q(0.5),
        "p90": q(0.9),
        "max": xs[-1],
    }


def alone(cfg_path: Path, init_dir: Path, steps: int, out: Path) -> None:
    """The child process of step 1 (module docstring): engine alone, trainer alone, then the policy saved."""
    import torch

    from moerl.config import load_config
    from moerl.runtime.build import build_components
    from moerl.runtime.local import LocalRollouts
    from moerl.train import export_policy
    from moerl.trainer.distributed.factory import make_trainer

    cfg = load_config(cfg_path, ["runtime.mode=sync"])
    torch.manual_seed(cfg.seed)
    cuda = cfg.model.device.startswith("cuda")
    t0 = time.perf_counter()
    with torch.device(cfg.model.device):  # a fresh policy initialized on its device (the bench's own weights)
        comp = build_components(cfg, None, None)
    build_s = time.perf_counter() - t0
    rollouts = LocalRollouts.start(cfg, comp, 0, None)
    n = cfg.trainer.batch_groups
    gen, batches, resp_lens, prompt_lens = [], [], [], []
    for i in range(steps + 1):  # the first batch captures the CUDA graphs: not timed
        groups, gen_s, _ = rollouts.next_groups(n)
        tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
        batches.append(groups)
        if i:
            gen.append({"gen_s": gen_s, "tokens": tokens, "tokens_per_s": tokens / gen_s})
        resp_lens += [len(s.response_ids) for g in groups for s in g.samples]
        prompt_lens += [len(g.samples[0].prompt_ids) for g in groups]
    max_new = cfg.rollout.max_new_tokens
    truncated = sum(x >= max_new for x in resp_lens) / len(resp_lens)
    graphs = getattr(rollouts.worker.engine, "_graphs", None)  # the run's engine: did decode replay graphs?
    graph_use = (
        None
        if graphs is None
        else {
            "enabled": graphs.is_enabled,
            "graphs": graphs.num_graphs,
            "captures": graphs.num_captures,
            "evictions": graphs.num_evictions,
            "replays": graphs.num_replays,
        }
    )
    rollouts.close()
    del rollouts, graphs  # the trainer alone: no engine beside it
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    engine_peak = torch.cuda.max_memory_allocated() if cuda else None
    trainer = make_trainer(cfg, comp.model, None, init_dir.parent / "scratch")
    train = []
    for i, groups in enumerate(batches):  # the first step warms up: not timed
        stats = trainer.train_step(trainer.build_batch(groups, comp.tokenizer.pad_id))
        if i:
            train.append(
                {
                    "train_s": stats.train_s,
                    "tokens": stats.num_tokens,
                    "tokens_per_s": stats.num_tokens / stats.train_s,
                }
            )
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    export_policy(trainer, comp.tokenizer, init_dir)
    payload = {
        "num_params": sum(p.numel() for p in comp.model.parameters()),
        "vocab_size": comp.tokenizer.vocab_size,
        "build_s": build_s,
        "save_s": time.perf_counter() - t1,
        "engine": {
            "steps": gen,
            "tokens_per_s": statistics.median(g["tokens_per_s"] for g in gen),
            "gen_s": statistics.median(g["gen_s"] for g in gen),
        },
        "trainer": {
            "steps": train,
            "tokens_per_s": statistics.median(t["tokens_per_s"] for t in train),
            "train_s": statistics.median(t["train_s"] for t in train),
        },
        "response_len": {**_quantiles(resp_lens), "truncated_frac": truncated, "max_new_tokens": max_new},
        "prompt_len": _quantiles(prompt_lens),
        "sequences_per_step": n * cfg.rollout.group_size,
        "cuda_graphs": graph_use,
        "peak_gpu_bytes_engine": engine_peak,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    out.write_text(json.dumps(payload, indent=1))


class GpuPeak:
    """Peak device memory of GPU ``index`` (all processes, MiB) from nvidia-smi every 0.5 s; None without it."""

    def __init__(self, index: int = 0) -> None:
        self.index, self.peak_mib, self._stop = index, None, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        cmd = ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                used = int(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.split()[0])
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return  # no NVIDIA driver (CPU runs)
            self.peak_mib = max(self.peak_mib or 0, used)
            self._stop.wait(0.5)

    def __enter__(self) -> GpuPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def launch(cmd: list[str], log: Path, timeout_s: float, env: dict) -> dict:
    """Run ``cmd``, its stdout and stderr (merged) copied to ``log`` with each line's second since launch;
    returns rc, wall seconds, the second the first RL step's console line came, capture-failure lines and
    the log's last lines (60 when the run failed, else 8: the device machine's files do not come back)."""
    t0 = time.perf_counter()
    first_step, failures, tail = None, [], []
    with GpuPeak() as peak, log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                t = time.perf_counter() - t0
                f.write(f"[{t:8.2f}] {line}")
                f.flush()
                if first_step is None and FIRST_STEP.search(line):
                    first_step = t
                if CAPTURE_FAILED.search(line):
                    failures.append(line.strip()[:4000])
                tail = (tail + [line.rstrip()[:1000]])[-60:]
            rc = proc.wait()
        finally:
            timer.cancel()
    return {
        "rc": rc,
        "timed_out": rc == -9,
        "wall_s": time.perf_counter() - t0,
        "first_step_s": first_step,
        "capture_failed": failures,
        "peak_gpu_mib": peak.peak_mib,
        "log": str(log),
        "log_tail": tail if rc != 0 else tail[-8:],
    }


def _median(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def steady_steps(steps: list[dict]) -> list[dict]:
    """The steps a run repeats: after the first (CUDA graph captures, allocator warm-up), not the last
    (the run's final save, ``timing/final_save_s``) and without a held-out eval (a step that evaluated logs
    ``eval/accuracy``; ``timing/eval_s`` is a few microseconds on every step, the timer's own cost).
    What the parts alone are compared with: they generate and train, nothing else. [] when none is left."""
    last = steps[-1]["step"] if steps else None
    return [s for s in steps[1:] if s["step"] != last and s.get("eval/accuracy") is None]


def summarize_steps(steps: list[dict], alone_res: dict | None) -> dict:
    """A run's per-step rows (``STEP_FIELDS`` and ``step``), their medians over the steady steps
    (``steady_steps``) and after step 1, and the ratios to the figures alone (``ratios``: of the steady
    medians; ``..._all_after_step1`` of the others; only when ``alone_res`` is given)."""
    later, steady = steps[1:] or steps, steady_steps(steps)
    med_all = {k: _median(later, k) for k in STEP_FIELDS}
    med = {k: _median(steady, k) for k in STEP_FIELDS}
    out = {
        "steps": steps,
        "steady_steps": [s["step"] for s in steady],
        "median_steady": med,
        "median_after_step1": med_all,
    }
    if alone_res:
        eng, tr = alone_res["engine"], alone_res["trainer"]
        ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
        out["ratios"] = {
            "rollout_tokens_per_s_over_alone": ratio(med["perf/rollout_tokens_per_s"], eng["tokens_per_s"]),
            "train_tokens_per_s_over_alone": ratio(med["perf/train_tokens_per_s"], tr["tokens_per_s"]),
            "step_s_over_gen_plus_train_alone": ratio(med["perf/step_time_s"], eng["gen_s"] + tr["train_s"]),
            "step_s_over_gen_plus_train_alone_all_after_step1": ratio(
                med_all["perf/step_time_s"], eng["gen_s"] + tr["train_s"]
            ),
        }
    return out


def resummarize(path: Path) -> dict:
    """Recompute every run's medians and ratios of a result file from the per-step rows and the figures
    alone that it holds (after a change to ``steady_steps`` or ``summarize_steps``); the file is rewritten
    atomically, nothing measured changes. Raises ValueError if ``path`` holds no ``results``."""
    doc = json.loads(path.read_text())
    if "results" not in doc:
        raise ValueError(f"{path}: not an e2e_gpu result file (no 'results')")
    for res in doc["results"].values():
        for entry in res.values():
            if isinstance(entry, dict) and "steps" in entry and entry["steps"]:
                entry.update(summarize_steps(entry["steps"], res.get("alone")))
    doc["resummarized"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    atomic_write_text(path, json.dumps(doc, indent=1))
    return doc


def summarize_run(run_dir: Path | None, alone_res: dict | None) -> dict:
    """Per-step figures of a finished run folder, their medians over the steady steps (``steady_steps``)
    and after step 1 (every later step, eval and final save included), with the ratios to the figures
    alone (of the steady medians; ``..._all_after_step1`` of the others)."""
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return {"steps": [], "error": "no metrics.jsonl"}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = summarize_steps(
        [{"step": r["step"], **{k: r.get(k) for k in STEP_FIELDS}} for r in rows], alone_res
    )
    if (run_dir / "summary.json").exists():
        s = json.loads((run_dir / "summary.json").read_text())
        out["summary"] = {
            k: s.get(k)
            for k in (
                "status",
                "steps",
                "wall_time_s",
                "process_wall_s",
                "tasks_lost",
                "tasks_duplicated",
                "start_eval_accuracy",
                "final_eval_accuracy",
                "startup_s",
            )
        }
    # capture failures written to files of the run folder (Ray worker logs land in the console too)
    out["capture_failed_in_folder"] = [
        str(p) for p in run_dir.rglob("*.log") if CAPTURE_FAILED.search(p.read_text(errors="replace"))
    ]
    return out


def _new_run_dir(runs: Path, before: set[Path]) -> Path | None:
    new = sorted(set(runs.glob("*")) - before, key=lambda p: p.stat().st_mtime) if runs.exists() else []
    return new[-1] if new else None


def bench_size(size: str, args, env: dict, save=lambda res: None) -> dict:
    """Alone, then one run per mode, of one size; ``save(res)`` after each (a call cut short keeps what
    finished)."""
    work = Path(args.work_dir) / size
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (3 if size == "tiny" else 6)
    cfg = run_config(size, args.device, work, steps, eval_every=args.eval_every)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    init_dir, alone_json = work / "init", work / "alone.json"
    res: dict = {"config": cfg}
    if args.no_alone and alone_json.exists() and (init_dir / "config.json").exists():
        res["alone"] = json.loads(alone_json.read_text())
        res["alone"]["reused"] = True
    else:
        cmd = [
            sys.executable,
            __file__,
            "--alone",
            str(cfg_path),
            "--init-dir",
            str(init_dir),
            "--alone-steps",
            str(args.alone_steps),
            "--alone-out",
            str(alone_json),
        ]
        res["alone_launch"] = launch(cmd, work / "alone.log", args.run_timeout_s, env)
        res["alone"] = json.loads(alone_json.read_text()) if res["alone_launch"]["rc"] == 0 else None
    print(f"[e2e] {size} alone: {json.dumps(_brief_alone(res['alone']))}", flush=True)
    save(res)
    for mode in args.modes:
        runs = work / "runs"
        before = set(runs.glob("*")) if runs.exists() else set()
        sets = [f"runtime.mode={mode}", f"init_from={init_dir}", f"runtime.weight_sync={args.weight_sync}"]
        cmd = [sys.executable, "-m", "moerl.cli", "train", "--config", str(cfg_path)]
        for s in sets:
            cmd += ["--set", s]
        launched = launch(cmd, work / f"run_{mode}_{args.weight_sync}.log", args.run_timeout_s, env)
        run_dir = _new_run_dir(runs, before)
        entry = {
            "env": _env_facts(),
            "command": " ".join(cmd),
            "run_dir": str(run_dir),
            **launched,
            **summarize_run(run_dir, res["alone"]),
        }
        if run_dir is not None and not args.keep_weights:  # 13.8 GB each at 6.9 B: the disk is 64 GB
            for sub in ("policy", "weights", "checkpoints", "sft"):
                shutil.rmtree(run_dir / sub, ignore_errors=True)
        key = mode if mode == "sync" or args.weight_sync == "object_store" else f"{mode}_{args.weight_sync}"
        res[key] = entry
        save(res)
        print(
            f"[e2e] {size} {key}: rc={launched['rc']} first_step_s={launched['first_step_s']} "
            f"peak_gpu_mib={launched['peak_gpu_mib']} capture_failed={len(launched['capture_failed'])} "
            f"steady={entry.get('steady_steps')} median={json.dumps(entry.get('median_steady'))} "
            f"ratios={json.dumps(entry.get('ratios'))}",
            flush=True,
        )
    return res


def _brief_alone(a: dict | None) -> dict | None:
    if a is None:
        return None
    return {
        "params": a["num_params"],
        "engine_tok_s": a["engine"]["tokens_per_s"],
        "gen_s": a["engine"]["gen_s"],
        "trainer_tok_s": a["trainer"]["tokens_per_s"],
        "train_s": a["trainer"]["train_s"],
        "response_len": a["response_len"],
        "cuda_graphs": a["cuda_graphs"],
    }


def _env_facts() -> dict:
    facts = {"utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    try:
        facts["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        facts["gpu"] = None
    facts["git"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (--tiny: cpu)")
    p.add_argument("--sizes", default="1b,6.9b", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--modes", default="sync,async", help="comma-separated, of sync, async")
    p.add_argument("--steps", type=int, default=0, help="RL steps per run (0: 6, tiny 3)")
    p.add_argument("--eval-every", type=int, default=3, help="eval.every of the runs")
    p.add_argument("--alone-steps", type=int, default=4, help="timed batches of the engine and trainer alone")
    p.add_argument(
        "--weight-sync",
        default="object_store",
        help="runtime.weight_sync of the async runs (results under async_<name> unless object_store)",
    )
    p.add_argument("--run-timeout-s", type=float, default=300.0, help="kill a child process after this")
    p.add_argument("--work-dir", default="/tmp/moerl_e2e", help="run folders, logs and the saved policies")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--no-alone", action="store_true", help="reuse the alone figures and policy of --work-dir")
    p.add_argument(
        "--keep-weights",
        action="store_true",
        help="keep each run folder's policy, weight store and checkpoints (deleted by default)",
    )
    p.add_argument("--tiny", action="store_true", help="the whole script on CPU at the tiny size")
    p.add_argument(
        "--resummarize",
        metavar="RESULT_JSON",
        help="recompute the medians and ratios of a result file from its per-step rows, then exit",
    )
    p.add_argument("--alone", help=argparse.SUPPRESS)
    p.add_argument("--init-dir", help=argparse.SUPPRESS)
    p.add_argument("--alone-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resummarize:
        resummarize(Path(args.resummarize))
        return 0
    if args.alone:
        alone(Path(args.alone), Path(args.init_dir), args.alone_steps, Path(args.alone_out))
        return 0
    if args.tiny:
        args.device, args.sizes, args.eval_every = "cpu", "tiny", 2
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    for s in args.sizes:
        if s not in SIZES:
            p.error(f"--sizes: unknown size {s!r}; choose from {sorted(SIZES)}")
    for m in args.modes:
        if m not in ("sync", "async"):
            p.error(f"--modes: unknown mode {m!r}; choose sync or async")
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"e2e_gpu_{datetime.datetime.now(datetime.UTC):%Y-%m-%d}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"results": {}}
    doc["env"] = _env_facts()
    for size in args.sizes:
        old = doc["results"].get(size, {})

        def save(res: dict, size=size, old=old) -> None:
            doc["results"][size] = {**old, **res}  # a later call's modes replace the same modes only
            atomic_write_text(path, json.dumps(doc, indent=1))

        save(bench_size(size, args, env, save))
    print(f"[e2e] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
