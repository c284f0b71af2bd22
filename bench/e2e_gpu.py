"""End-to-end benchmark of `moerl train` on one GPU (issues 32, 47): the shipped configs, run as a user runs
them, against their parts alone.

The runs are ``configs/gpu_single.yaml`` (sizes 1b and 6.9b) and ``configs/default.yaml`` (tiny, CPU) with
only the size, the steps, the device, the run folder and the starting policy overridden (``SIZES``,
``run_overrides``); every override is listed in the result JSON (``overrides``). No publish, durability or
engine setting is overridden: the figures are those of the defaults.

For each model size (``--sizes``) in one call:
1. **alone** (a child process, ``--alone``): the run's own config, policy, engine and trainer, built as a
   run builds them (``moerl.runtime.build``, ``LocalRollouts``, ``make_trainer``) on the same GPU, in steady
   state: the engine generates warm-up batches until one captures no new CUDA graph, then
   ``--alone-steps`` timed batches with no trainer present (engine alone); the trainer trains on the
   warm-up batches untimed, then on the timed ones (trainer alone; the run's batch shapes). It saves the
   policy as a Hugging Face folder, which every run of that size starts from (``init_from``: no warm start).
2. **runs** (``--modes``): ``python3 -m moerl.cli train`` subprocesses, sync and async, on GSM8K prompts.
   Per step from the run's ``metrics.jsonl``: generation, training, weight handoff (``timing/publish_s``;
   async also ``timing/weight_sync_s`` and the worker side), waiting, eval (``timing/eval_s``), step
   time, rollout and training tokens/s; the time from the command to the first RL step (its console
   line) and ``summary.json``'s start milestones (``startup_s``); the GPU's peak memory (nvidia-smi, every
   0.5 s, all processes); the versions in the weight store at the end; and every line of the run log
   matching "capture failed" (a CUDA graph that fell back to eager decoding).

Ratios (from one call, the GPU being shared and noisy): in-run rollout tokens/s over the engine alone (sync
runs), in-run training tokens/s over the trainer alone, step time over (generation alone + training alone).
Medians over the steady steps: after the first (which captures CUDA graphs and warms the allocator), not
the last (the run's final save, ``timing/final_save_s``), without a held-out eval (the parts alone do
neither); the step-time ratio over every step after the first is given beside it. An in-run ratio above
``BASELINE_FAULT_ABOVE`` is printed as a baseline fault, not as a result (``baseline_faults``).

Prompts: the first 512 GSM8K test problems (bench/data, MIT licence, OpenAI), tokenized by moerl's bundled
BPE tokenizer (99 tokens, about one per character: prompts of ~100-630 tokens); responses sampled at
temperature 1 up to ``max_new_tokens`` (256 on the GPU) from a randomly initialized policy, so their lengths
follow its end-of-sequence draws (the JSON states the measured quantiles and the truncated fraction).
Sizes (the vocabulary is the tokenizer's 99, so the embedding and lm_head are small):
  1b    configs/gpu_single.yaml as shipped: hidden 1024, 8 layers, 8 heads x 128, 64 experts top-8 of
        width 512, bf16 (~0.86 B parameters)
  6.9b  the same config at the benchmarks' ``reference`` shape: hidden 2048, 16 layers, 16 heads x 128, 64
        experts top-8 of width 1024 (~6.7 B parameters with this vocabulary), micro-batches of 16
  tiny  configs/default.yaml on CPU (``--tiny``: every step of the script in a minute)

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
CAPTURE_FAILED = re.compile(r"capture failed", re.IGNORECASE)
FIRST_STEP = re.compile(r"\bstep 1/\d+")


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


# The runs are the shipped configs as a user starts them. Each size names its config and the only fields it
# overrides: the model's size, and the micro-batch that size needs to fit. Every run also overrides
# ``trainer.steps``, ``model.device``, ``output_dir`` and ``init_from`` (every run of a size starts from the
# same saved policy and skips the warm start), and ``runtime.mode``; the result JSON lists every override.
SIZES: dict[str, dict] = {
    "tiny": {"config": "configs/default.yaml", "overrides": []},  # a CPU smoke size (--tiny)
    "1b": {"config": "configs/gpu_single.yaml", "overrides": []},  # the config's own ~0.9 B shape
    "6.9b": {  # the benchmarks' ``reference`` shape (``moerl.plan.models.MODELS``) on the same config
        "config": "configs/gpu_single.yaml",
        "overrides": [f"model.{k}={v}" for k, v in _shape_fields(MODELS["reference"]).items()]
        + ["trainer.micro_batch_size=16"],  # 32 x 8 sequences of up to 889 tokens fit beside the engine
    },
}
BASELINE_FAULT_ABOVE = 1.1
"""A run faster than its part alone by more than this measures the baseline's warm-up, not the run: such a
ratio is reported as a baseline fault (``baseline_faults``), not as a result."""

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


def run_overrides(size: str, device: str, work: Path, steps: int) -> list[str]:
    """The ``--set`` overrides of every run of ``size`` on top of its shipped config (mode and ``init_from``
    are added per run): the size's own, then steps, device and the run folder's place."""
    return [
        *SIZES[size]["overrides"],
        f"trainer.steps={steps}",
        f"model.device={device}",
        f"output_dir={work / 'runs'}",
    ]


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


def _num_captures(rollouts) -> int | None:
    """CUDA graphs the run's engine has captured so far (None: no graphs, e.g. on CPU)."""
    graphs = getattr(rollouts.worker.engine, "_graphs", None)
    return None if graphs is None else graphs.num_captures


def alone(config: str, overrides: list[str], init_dir: Path, steps: int, max_warmup: int, out: Path) -> None:
    """The child process of step 1 (module docstring): engine alone, trainer alone, then the policy saved.

    Both baselines are taken in steady state, as the run's steady steps are: the engine generates warm-up
    batches until one captures no new CUDA graph (at most ``max_warmup``; every batch size the run meets has
    its graph then, kernels are compiled and the allocator is warm), then ``steps`` timed batches; the trainer
    trains on the warm-up batches untimed, then on the timed batches (the run's batch shapes)."""
    import torch

    from moerl.config import load_config
    from moerl.runtime.build import build_components
    from moerl.runtime.local import LocalRollouts
    from moerl.train import export_policy
    from moerl.trainer.distributed.factory import make_trainer

    cfg = load_config(config, [*overrides, "runtime.mode=sync"])
    torch.manual_seed(cfg.seed)
    cuda = cfg.model.device.startswith("cuda")
    t0 = time.perf_counter()
    with torch.device(cfg.model.device):  # a fresh policy initialized on its device (the bench's own weights)
        comp = build_components(cfg, None, None)
    build_s = time.perf_counter() - t0
    rollouts = LocalRollouts.start(cfg, comp, 0, None)
    n = cfg.trainer.batch_groups
    warmup, timed, resp_lens, prompt_lens = [], [], [], []
    while len(timed) < steps:
        before = _num_captures(rollouts)
        groups, gen_s, _ = rollouts.next_groups(n)
        new_captures = None if before is None else _num_captures(rollouts) - before
        tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
        row = {"gen_s": gen_s, "tokens": tokens, "tokens_per_s": tokens / gen_s, "new_captures": new_captures}
        is_warm = warmup and (not new_captures or len(warmup) >= max_warmup)  # the first batch never counts
        (timed if is_warm else warmup).append((row, groups))
        if is_warm:
            resp_lens += [len(s.response_ids) for g in groups for s in g.samples]
            prompt_lens += [len(g.samples[0].prompt_ids) for g in groups]
    gen = [r for r, _ in timed]
    max_new = cfg.rollout.max_new_tokens
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
    for _, groups in warmup:  # the trainer's warm-up: its allocator and kernels, untimed
        trainer.train_step(trainer.build_batch(groups, comp.tokenizer.pad_id))
    train = []
    for _, groups in timed:
        stats = trainer.train_step(trainer.build_batch(groups, comp.tokenizer.pad_id))
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
        "warmup_batches": [r for r, _ in warmup],
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
        "response_len": {
            **_quantiles(resp_lens),
            "truncated_frac": sum(x >= max_new for x in resp_lens) / len(resp_lens),
            "max_new_tokens": max_new,
        },
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


def summarize_steps(steps: list[dict], alone_res: dict | None, mode: str = "sync") -> dict:
    """A run's per-step rows (``STEP_FIELDS`` and ``step``), their medians over the steady steps
    (``steady_steps``) and after step 1, and the ratios to the figures alone (``ratios``: of the steady
    medians; ``..._all_after_step1`` of the others; only when ``alone_res`` is given). The rollout ratio is
    given for sync runs only: an async step's ``timing/gen_s`` sums its groups' generation times, which
    overlap. Ratios above ``BASELINE_FAULT_ABOVE`` are named in ``baseline_faults``: the run beat its part
    alone, so the part alone was not in steady state and the ratio is no result."""
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
        in_run = {
            "rollout_tokens_per_s_over_alone": ratio(med["perf/rollout_tokens_per_s"], eng["tokens_per_s"])
            if mode == "sync"
            else None,
            "train_tokens_per_s_over_alone": ratio(med["perf/train_tokens_per_s"], tr["tokens_per_s"]),
        }
        out["ratios"] = {
            **in_run,
            "step_s_over_gen_plus_train_alone": ratio(med["perf/step_time_s"], eng["gen_s"] + tr["train_s"]),
            "step_s_over_gen_plus_train_alone_all_after_step1": ratio(
                med_all["perf/step_time_s"], eng["gen_s"] + tr["train_s"]
            ),
        }
        out["baseline_faults"] = [k for k, v in in_run.items() if v is not None and v > BASELINE_FAULT_ABOVE]
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
                entry.update(summarize_steps(entry["steps"], res.get("alone"), entry.get("mode", "sync")))
    doc["resummarized"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    atomic_write_text(path, json.dumps(doc, indent=1))
    return doc


def summarize_run(run_dir: Path | None, alone_res: dict | None, mode: str = "sync") -> dict:
    """Per-step figures of a finished run folder, their medians over the steady steps (``steady_steps``)
    and after step 1 (every later step, eval and final save included), with the ratios to the figures
    alone (of the steady medians; ``..._all_after_step1`` of the others)."""
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return {"steps": [], "error": "no metrics.jsonl"}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = summarize_steps(
        [{"step": r["step"], **{k: r.get(k) for k in STEP_FIELDS}} for r in rows], alone_res, mode
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
    config = SIZES[size]["config"]
    overrides = run_overrides(size, args.device, work, steps)
    overrides += [f"runtime.weight_sync={args.weight_sync}"] if args.weight_sync else []
    init_dir, alone_json = work / "init", work / "alone.json"
    res: dict = {"config": config, "overrides": overrides}
    if args.no_alone and alone_json.exists() and (init_dir / "config.json").exists():
        res["alone"] = json.loads(alone_json.read_text())
        res["alone"]["reused"] = True
    else:
        cmd = [sys.executable, __file__, "--alone", config, "--init-dir", str(init_dir)]
        cmd += ["--alone-steps", str(args.alone_steps), "--alone-max-warmup", str(args.alone_max_warmup)]
        cmd += ["--alone-out", str(alone_json), *[f"--alone-set={o}" for o in overrides]]
        res["alone_launch"] = launch(cmd, work / "alone.log", args.run_timeout_s, env)
        res["alone"] = json.loads(alone_json.read_text()) if res["alone_launch"]["rc"] == 0 else None
    print(f"[e2e] {size} alone: {json.dumps(_brief_alone(res['alone']))}", flush=True)
    save(res)
    for mode in args.modes:
        runs = work / "runs"
        before = set(runs.glob("*")) if runs.exists() else set()
        sets = [*overrides, f"runtime.mode={mode}", f"init_from={init_dir}"]
        cmd = [sys.executable, "-m", "moerl.cli", "train", "--config", config]
        for s in sets:
            cmd += ["--set", s]
        launched = launch(cmd, work / f"run_{mode}.log", args.run_timeout_s, env)
        run_dir = _new_run_dir(runs, before)
        entry = {
            "env": _env_facts(),
            "mode": mode,
            "command": " ".join(cmd),
            "overrides": sets,
            "run_dir": str(run_dir),
            **launched,
            **summarize_run(run_dir, res["alone"], mode),
        }
        entry["store_versions"] = _store_versions(run_dir)
        if run_dir is not None and not args.keep_weights:  # 13.8 GB each at 6.9 B: the disk is 64 GB
            for sub in ("policy", "weights", "checkpoints", "sft"):
                shutil.rmtree(run_dir / sub, ignore_errors=True)
        res[mode] = entry
        save(res)
        faults = entry.get("baseline_faults")
        print(
            f"[e2e] {size} {mode}: rc={launched['rc']} first_step_s={launched['first_step_s']} "
            f"peak_gpu_mib={launched['peak_gpu_mib']} capture_failed={len(launched['capture_failed'])} "
            f"steady={entry.get('steady_steps')} median={json.dumps(entry.get('median_steady'))} "
            f"ratios={json.dumps(entry.get('ratios'))} store_versions={entry['store_versions']}"
            + (f" BASELINE FAULT (the part alone was slower than in the run): {faults}" if faults else ""),
            flush=True,
        )
    return res


def _store_versions(run_dir: Path | None) -> list[int] | None:
    """The policy versions the run's local weight store holds (``weights/v<N>`` folders), None without one."""
    if run_dir is None or not (run_dir / "weights").is_dir():
        return None
    found = (re.fullmatch(r"v(\d+)", p.name) for p in (run_dir / "weights").iterdir())
    return sorted(int(m.group(1)) for m in found if m)


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
    # BENCH_GIT: the commit of a copied tree whose .git is not its own (the device tool's copy)
    facts["git"] = (
        os.environ.get("BENCH_GIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    )
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (--tiny: cpu)")
    p.add_argument("--sizes", default="1b,6.9b", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--modes", default="sync,async", help="comma-separated, of sync, async")
    p.add_argument("--steps", type=int, default=0, help="RL steps per run (0: 6, tiny 3)")
    p.add_argument("--alone-steps", type=int, default=4, help="timed batches of the engine and trainer alone")
    p.add_argument(
        "--alone-max-warmup", type=int, default=4, help="warm-up batches alone at most (until no new graph)"
    )
    p.add_argument(
        "--weight-sync",
        help="an override of runtime.weight_sync (listed in the JSON's overrides; default: the config's)",
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
    p.add_argument("--alone-set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--init-dir", help=argparse.SUPPRESS)
    p.add_argument("--alone-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resummarize:
        resummarize(Path(args.resummarize))
        return 0
    if args.alone:
        alone(
            args.alone,
            args.alone_set,
            Path(args.init_dir),
            args.alone_steps,
            args.alone_max_warmup,
            Path(args.alone_out),
        )
        return 0
    if args.tiny:
        args.device, args.sizes = "cpu", "tiny"
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
