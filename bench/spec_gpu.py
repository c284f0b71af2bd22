"""Speculative rollout on one GPU (issue 49's GPU figure): the 1 B policy of ``configs/gpu_single.yaml`` with
its MTP module after a short SFT of both, decoding with ``rollout.speculative=off`` and ``=mtp`` on the
long-tail workload of ``bench/paged_kv.py`` and on the uniform B=256, 128+128 workload of
``bench/rollout_gpu.py``; tokens/s each way, their ratio and the MTP acceptance rate. One process.

    python3 bench/spec_gpu.py --device cuda --out $OUT/spec_gpu.json     # the device call (bench/spec_call.sh)
    python3 bench/spec_gpu.py --device cpu --tiny --out /tmp/spec_gpu.json  # the same code at a tiny shape

1. **Policy and SFT.** ``configs/gpu_single.yaml`` (Qwen3-MoE, hidden 1024, 8 layers, 64 experts top-8,
   bf16) with ``model.max_position_embeddings`` raised to fit the tail's 8192-token responses, a fresh MTP
   module (DeepSeek-V3 style, ``moerl.models.mtp.attach_fresh_mtp``), then moerl's SFT
   (``moerl.tasks.sft.train_sft``: the config's ``sft:`` batch size and LR, ``--sft-steps`` steps) on the
   training rows of ``bench/data/gsm8k_test_512.jsonl`` with the MTP loss added at
   ``trainer.mtp_loss_weight``. Before and after it: the held-out rows' completion NLL and the MTP module's
   loss and accuracy (share of targets whose MTP argmax is the token after next), teacher-forced.
2. **Long tail** (``bench/engine_ab_call.sh``'s TAIL at the 1 B shape): ``--prompts`` groups of ``--group``
   samples at temperature 1, no stop tokens, each group's response length from ``paged_kv.response_lengths``
   (median ``--median-new``, 1% at ``--max-new``); the paged engine of ``paged_kv.py`` (``--max-slots``
   rows, KV memory of ``--kv-slots`` x (512 + max-new) tokens, pow2 batch buckets, ``--sync-every``).
   Prompts: the held-out GSM8K prompts (``--tail-prompts gsm8k``, default: text the SFT did not see) or
   paged_kv's 512 random tokens (``synthetic``). A 4-token warm-up, then ``--tail-passes`` timed passes
   (``paged_kv.timed_pass``: prefix index emptied before each); the figure is the median of the passes
   after the first (graphs captured in it).
3. **Uniform**: ``--uniform-batch`` random prompts (``bench.common.random_prompts``) of
   ``--uniform-prompt-len`` tokens, exactly ``--uniform-new`` new tokens each at temperature 1, one paged
   engine sized as ``rollout_gpu.engine_for`` (``--kv-cache paged``); ``--uniform-passes`` passes, the
   figure the median after the first.

Each workload runs twice on the same weights: an engine without speculation, then the same engine with
``Engine.speculation`` built from ``rollout.speculative=mtp`` (``SpeculativeDecoding.from_config``: the
shipped ``speculative_tokens``, ``speculative_max_batch`` and ``SpecPolicy``, whose automatic turn-down
stays on). Per pass: tokens/s, and from the engine's counters the speculative steps, drafted and accepted
tokens (acceptance rate = accepted / drafted), steps decoded plainly because the batch was above
``speculative_max_batch``, the acceptance too low or speculation measured slower (``num_off_cost``; and
the plain probes), and where the time went: mean ms per speculative step and per plain step (the
``SpecPolicy``'s host-time measurements at the host syncs), ms per decode step of any kind, and the CUDA
graphs captured and replayed. The JSON (``--out``, rewritten after every phase so a
cut-off call keeps what finished) holds the GPU, the git commit, every config override and every workload
argument; one summary line per figure is printed (``[spec_gpu] ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import random_prompts, write_json  # noqa: E402
from bench.paged_kv import group_requests, parse_device, pow2_buckets, run, timed_pass  # noqa: E402
from bench.rollout_gpu import sampling_requests  # noqa: E402
from moerl.config import RunConfig, load_config  # noqa: E402
from moerl.models import build_model  # noqa: E402
from moerl.models.mtp import attach_fresh_mtp, mtp_loss  # noqa: E402
from moerl.rollout import Engine, Request  # noqa: E402
from moerl.rollout.spec_decode import SpeculativeDecoding  # noqa: E402
from moerl.tasks import make_task  # noqa: E402
from moerl.tasks.examples import collate, encode_example  # noqa: E402
from moerl.tasks.sft import completion_nll, train_sft  # noqa: E402
from moerl.tasks.tokenizer import load_run_tokenizer  # noqa: E402

CONFIG = REPO / "configs" / "gpu_single.yaml"
SYNTHETIC_PROMPT_LEN = 512
"""paged_kv's prompt length in the TAIL arguments; also the per-slot prompt share of the KV memory."""
TINY_MODEL = (
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_intermediate_size=64",
    "model.dtype=float32",
)
"""``--tiny``: the model shape overrides (same family and code paths, seconds on a CPU)."""
TINY_ARGS = dict(
    sft_steps=4,
    sft_batch=2,
    prompts=3,
    group=2,
    median_new=12,
    max_new=40,
    kv_slots=3,
    max_slots=16,
    tail_passes=2,
    uniform_batch=36,
    uniform_prompt_len=16,
    uniform_new=16,  # whole blocks: all 36 rows fit the engine_for budget and decode together
    uniform_passes=2,
    eval_rows=4,
)
"""``--tiny``: workload sizes (the uniform batch stays above the shipped ``speculative_max_batch``, 32)."""


def config_overrides(args: argparse.Namespace) -> list[str]:
    """Every override of ``configs/gpu_single.yaml`` this call makes (the JSON lists them)."""
    longest_prompt = SYNTHETIC_PROMPT_LEN if args.tail_prompts == "synthetic" else 1024
    context = max(16384, longest_prompt + args.max_new)
    out = [
        f"model.device={args.device}",
        f"model.max_position_embeddings={context}",  # the tail's responses reach --max-new tokens
        f"sft.steps={args.sft_steps}",
        f"trainer.mtp_loss_weight={args.mtp_loss_weight}",
        f"seed={args.seed}",
    ]
    if args.sft_batch is not None:
        out.append(f"sft.batch_size={args.sft_batch}")
    return out + (list(TINY_MODEL) if args.tiny else [])


# -- 1. policy, MTP module, SFT -----------------------------------------------------------------


def heldout_mtp(model, tokenizer, prompts, device, batch: int = 16) -> dict:
    """Teacher-forced figures on held-out SFT examples: completion NLL (nats/token), MTP loss (nats) and
    MTP accuracy (share of completion targets t_{i+2} equal to the MTP argmax), token-weighted means."""
    examples = [encode_example(tokenizer, p) for p in prompts if p.solution]
    sums = {"completion_nll": 0.0, "mtp_loss": 0.0, "mtp_accuracy": 0.0}
    weight = weight_next = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            b = collate(examples[i : i + batch], tokenizer.pad_id, device)
            out = model(b.input_ids, b.attention_mask, return_hidden=True)
            m_loss, m_acc = mtp_loss(model, out.hidden, b.input_ids, b.loss_mask, b.attention_mask)
            n_next, n = float(b.loss_mask[:, 1:].sum()), float(b.loss_mask[:, 2:].sum())  # targets of each
            sums["completion_nll"] += float(completion_nll(out.logits, b)) * n_next
            sums["mtp_loss"] += float(m_loss) * n
            sums["mtp_accuracy"] += float(m_acc) * n
            weight_next += n_next
            weight += n
    model.train(was_training)
    return {
        "completion_nll": sums["completion_nll"] / max(weight_next, 1.0),
        "mtp_loss": sums["mtp_loss"] / max(weight, 1.0),
        "mtp_accuracy": sums["mtp_accuracy"] / max(weight, 1.0),
        "rows": len(examples),
        "mtp_targets": int(weight),
    }


def build_and_sft(cfg: RunConfig, args: argparse.Namespace, device: torch.device):
    """The policy of ``cfg`` with a fresh MTP module, SFT-ed with the MTP loss; returns (model, tokenizer,
    task, figures)."""
    torch.manual_seed(cfg.seed)
    tokenizer = load_run_tokenizer(cfg)
    task = make_task(cfg.task, cfg.env, tokenizer)
    t0 = time.perf_counter()
    model = attach_fresh_mtp(build_model(cfg.model, tokenizer.vocab_size))
    build_s = time.perf_counter() - t0
    held_out = task.eval_prompts()[: args.eval_rows]
    before = heldout_mtp(model, tokenizer, held_out, device)
    num_train = min(cfg.sft.num_examples, cfg.sft.steps * cfg.sft.batch_size)  # train_sft sees no more
    train = list(itertools.islice(task.train_prompts(cfg.seed), num_train))
    t0 = time.perf_counter()
    final_loss = train_sft(
        model,
        tokenizer,
        [p for p in train if p.solution],
        cfg.sft,
        seed=cfg.seed,
        max_len=cfg.model.max_position_embeddings,
        log_every=0,
        mtp_loss_weight=cfg.trainer.mtp_loss_weight,
    )
    _sync(device)
    model.zero_grad(set_to_none=True)  # the last step's gradients: memory the engines can use
    sft_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    after = heldout_mtp(model, tokenizer, held_out, device)
    model.eval()
    figures = {
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": tokenizer.vocab_size,
        "build_s": build_s,
        "steps": cfg.sft.steps,
        "batch_size": cfg.sft.batch_size,
        "lr": cfg.sft.lr,
        "mtp_loss_weight": cfg.trainer.mtp_loss_weight,
        "final_train_nll": final_loss,
        "seconds": sft_s,
        "peak_memory_gib": peak,
        "held_out_before": before,
        "held_out_after": after,
    }
    return model, tokenizer, task, figures


# -- 2./3. the workloads, each way ----------------------------------------------------------------


def tail_requests(args: argparse.Namespace, tokenizer, task) -> list[Request]:
    """paged_kv's long-tail workload: ``--prompts`` groups of ``--group``, lognormal lengths, no stop
    tokens, temperature 1 (``paged_kv.workload`` with the prompts of ``--tail-prompts``)."""
    if args.tail_prompts == "gsm8k":
        prompts = [tokenizer.encode(p.text) for p in task.eval_prompts()[: args.prompts]]
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(
            0, tokenizer.vocab_size, (args.prompts, SYNTHETIC_PROMPT_LEN), generator=gen
        ).tolist()
    return group_requests(prompts, args)


def tail_engine_args(args: argparse.Namespace) -> dict:
    """``Engine`` arguments of paged_kv's paged engine at the TAIL arguments (the JSON records them)."""
    return dict(
        cache="paged",
        max_slots=args.max_slots,
        block_size=16,
        batch_buckets=pow2_buckets(args.max_slots),
        kv_token_budget=args.kv_slots * (SYNTHETIC_PROMPT_LEN + args.max_new),
        sync_every=args.sync_every,
        seed=args.seed,
    )


def uniform_engine_args(args: argparse.Namespace) -> dict:
    """``Engine`` arguments of ``rollout_gpu.engine_for`` with ``--kv-cache paged`` at the uniform sizes
    (batch buckets: the engine's default, as there)."""
    b, p, n = args.uniform_batch, args.uniform_prompt_len, args.uniform_new
    return dict(
        cache="paged",
        max_slots=b,
        kv_token_budget=b * (p + n),
        max_prefill_tokens=b * p,
        sync_every=args.uniform_sync_every,
        seed=args.seed,
    )


_COUNTERS = (
    "spec_steps",
    "spec_drafted",
    "spec_accepted",
    "num_off_batch",
    "num_off_acceptance",
    "num_off_cost",
    "num_plain_probes",
    "spec_timed_s",
    "spec_timed_steps",
    "plain_timed_s",
    "plain_timed_steps",
    "graph_captures",
    "graph_replays",
)
"""Engine counters each pass reports the change of (``_spec_counters``); the ``*_timed_*`` pairs are the
``SpecPolicy``'s own host-time measurements (at the host syncs), from which ``per_step_figures`` derives
the mean milliseconds per speculative and per plain step."""


def _spec_counters(engine: Engine) -> dict[str, float]:
    spec = engine.speculation
    runners = [g for g in (engine._graphs, spec.graphs if spec is not None else None) if g is not None]
    counts = {
        "graph_captures": sum(g.num_captures for g in runners),
        "graph_replays": sum(g.num_replays for g in runners),
    }
    if spec is None:
        return dict.fromkeys(_COUNTERS, 0) | counts
    pol = spec.policy
    return counts | {
        "spec_steps": pol.num_spec_steps,
        "spec_drafted": spec.num_drafted,
        "spec_accepted": spec.num_accepted,
        "num_off_batch": pol.num_off_batch,
        "num_off_acceptance": pol.num_off_acceptance,
        "num_off_cost": pol.num_off_cost,
        "num_plain_probes": pol.num_plain_probes,
        "spec_timed_s": pol.totals["spec"][0],
        "spec_timed_steps": pol.totals["spec"][1],
        "plain_timed_s": pol.totals["plain"][0],
        "plain_timed_steps": pol.totals["plain"][1],
    }


def per_step_figures(moved: dict, fig: dict) -> dict:
    """Where a pass's time went: mean ms per speculative step and per plain step (host time measured by
    ``SpecPolicy`` at the host syncs; None: none measured), and the pass's seconds per decode step of
    any kind (prefills included)."""

    def ms(seconds: float, steps: int) -> float | None:
        return 1e3 * seconds / steps if steps else None

    return {
        "ms_per_spec_step": ms(moved["spec_timed_s"], moved["spec_timed_steps"]),
        "ms_per_plain_step": ms(moved["plain_timed_s"], moved["plain_timed_steps"]),
        "ms_per_decode_step_all": ms(fig.get("seconds", 0.0), fig.get("decode_steps", 0)),
    }


def timed_passes(
    engine: Engine,
    requests: list[Request],
    device: torch.device,
    passes: int,
    out: dict,
    *,
    deadline,
    on_pass,
) -> None:
    """A 4-token warm-up (``paged_kv.run``) and up to ``passes`` timed passes into ``out``, each with the
    speculation counters it moved; the figure is the median tokens/s of the passes after the first (or
    the first alone). A pass after the first that would likely end past ``deadline`` (``perf_counter``
    seconds; its predecessor's duration from now) is skipped and counted (``passes_skipped``), so a
    call keeps to its time; ``on_pass()`` runs after each pass (the JSON is rewritten)."""
    rows = out.setdefault("passes", [])
    out["passes_skipped"] = 0
    for i in range(passes):
        if i and deadline is not None and time.perf_counter() + rows[-1]["seconds"] > deadline:
            out["passes_skipped"] = passes - i
            break
        before = _spec_counters(engine)
        fig, _ = run(engine, requests, device) if i == 0 else timed_pass(engine, requests, device)
        after = _spec_counters(engine)
        moved = {k: after[k] - before[k] for k in _COUNTERS}
        moved["acceptance_rate"] = (
            moved["spec_accepted"] / moved["spec_drafted"] if moved["spec_drafted"] else None
        )
        rows.append(fig | moved | per_step_figures(moved, fig))
        steady = rows[1:] or rows
        rates = [r["acceptance_rate"] for r in steady if r["acceptance_rate"] is not None]
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
        out["acceptance_rate"] = statistics.median(rates) if rates else None
        out["spec_steps"] = sum(r["spec_steps"] for r in steady)
        for name in ("ms_per_spec_step", "ms_per_plain_step", "ms_per_decode_step_all"):
            values = [r[name] for r in steady if r[name] is not None]
            out[name] = statistics.median(values) if values else None
        out["graph_captures"] = sum(r["graph_captures"] for r in rows)
        out["figure_from"] = "passes after the first" if len(rows) > 1 else "the first pass"
        on_pass()


def both_ways(model, cfg: RunConfig, make_engine, requests, device, passes: int, out: dict, **kw) -> None:
    """The workload without speculation, then with ``rollout.speculative=mtp`` (the config's other
    speculative fields as shipped), into ``out`` (``off``, ``mtp``, ``ratio`` mtp / off tokens/s);
    ``kw``: ``timed_passes``' ``deadline`` and ``on_pass``. An exception in one way is recorded as its
    ``error`` (traceback on stderr) and the call goes on: one device call still measures the rest."""
    for mode in ("off", "mtp"):
        try:
            engine = make_engine()
            rollout = dataclasses.replace(cfg.rollout, speculative=mode)
            engine.speculation = SpeculativeDecoding.from_config(model, rollout)
            timed_passes(engine, requests, device, passes, out.setdefault(mode, {}), **kw)
        except Exception as e:  # noqa: BLE001 -- recorded, the call goes on
            traceback.print_exc()
            out.setdefault(mode, {})["error"] = f"{type(e).__name__}: {e}"
        engine = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "tokens_per_s" in out["off"] and "tokens_per_s" in out["mtp"]:
        out["ratio"] = out["mtp"]["tokens_per_s"] / out["off"]["tokens_per_s"]


# -- the call -----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _git() -> dict:
    def git(*a: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def _gpu(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def summary_line(result: dict, name: str) -> str:
    """The ``[spec_gpu]`` line of figure ``name`` (``sft``, ``uniform``, ``tail``) of ``result``."""
    r = result[name]
    if name == "sft":
        a, b = r["held_out_after"], r["held_out_before"]
        return (
            f"[spec_gpu] sft: {r['steps']} steps in {r['seconds']:.1f} s; held-out MTP accuracy "
            f"{b['mtp_accuracy']:.3f} -> {a['mtp_accuracy']:.3f}, completion NLL {b['completion_nll']:.3f} -> "
            f"{a['completion_nll']:.3f} nats/token"
        )
    if "ratio" not in r:
        errors = {m: r[m].get("error", "no figure") for m in ("off", "mtp") if "tokens_per_s" not in r[m]}
        return f"[spec_gpu] {name}: no ratio; {errors}"
    acc = r["mtp"]["acceptance_rate"]
    return (
        f"[spec_gpu] {name}: off {r['off']['tokens_per_s']:.1f} tok/s, mtp "
        f"{r['mtp']['tokens_per_s']:.1f} tok/s, ratio {r['ratio']:.3f}, acceptance "
        f"{'n/a (no speculative step)' if acc is None else f'{acc:.3f}'}, "
        f"speculative steps {r['mtp']['spec_steps']} ({r['mtp']['figure_from']}); ms per step: "
        f"speculative {_ms(r['mtp'].get('ms_per_spec_step'))}, plain {_ms(r['mtp'].get('ms_per_plain_step'))}, "
        f"off {_ms(r['off'].get('ms_per_decode_step_all'))} (all steps); graphs captured "
        f"{r['mtp'].get('graph_captures', 0)}"
    )


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model and workloads (CPU check of this script)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "spec_gpu.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--sft-batch", type=int, default=None, help="default: the config's sft.batch_size")
    p.add_argument("--mtp-loss-weight", type=float, default=1.0, help="trainer.mtp_loss_weight in the SFT")
    p.add_argument("--eval-rows", type=int, default=64, help="held-out rows of the MTP accuracy")
    p.add_argument("--tail-prompts", choices=("gsm8k", "synthetic"), default="gsm8k")
    p.add_argument("--prompts", type=int, default=32, help="tail: groups")
    p.add_argument("--group", type=int, default=8, help="tail: samples per group")
    p.add_argument("--median-new", type=int, default=300)
    p.add_argument("--max-new", type=int, default=8192)
    p.add_argument("--kv-slots", type=int, default=32, help="tail KV memory in slots of 512 + max-new")
    p.add_argument("--max-slots", type=int, default=512)
    p.add_argument("--sync-every", type=int, default=8, help="tail: steps between host syncs")
    p.add_argument("--tail-passes", type=int, default=2)
    p.add_argument("--uniform-batch", type=int, default=256)
    p.add_argument("--uniform-prompt-len", type=int, default=128)
    p.add_argument("--uniform-new", type=int, default=128)
    p.add_argument("--uniform-sync-every", type=int, default=16, help="rollout_gpu.py's default")
    p.add_argument("--uniform-passes", type=int, default=3)
    p.add_argument(
        "--budget-s",
        type=float,
        default=380.0,
        help="seconds from the start after which no further timed pass begins that would likely end later",
    )
    args = p.parse_args(argv)
    if args.tiny:  # tiny sizes unless given on the command line
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])}
        for k, v in TINY_ARGS.items():
            if k not in given:
                setattr(args, k, v)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors (``p.error``) before any model is built."""
    counts = ("sft_steps", "eval_rows", "prompts", "group", "median_new", "max_new", "kv_slots", "max_slots")
    counts += ("sync_every", "tail_passes", "uniform_batch", "uniform_prompt_len", "uniform_new")
    counts += ("uniform_sync_every", "uniform_passes")
    for k in counts:
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} {getattr(args, k)} must be >= 1")
    if args.sft_batch is not None and args.sft_batch < 1:
        p.error(f"--sft-batch {args.sft_batch} must be >= 1")
    if args.budget_s <= 0:
        p.error(f"--budget-s {args.budget_s} must be > 0")
    if args.mtp_loss_weight <= 0:
        p.error(f"--mtp-loss-weight {args.mtp_loss_weight} must be > 0 (the MTP module must train)")
    if args.median_new > args.max_new:
        p.error(f"--median-new {args.median_new} must be at most --max-new {args.max_new}")
    parse_device(p, args.device, " (use --device cpu --tiny for the CPU check)")
    if args.out.suffix != ".json":
        p.error(f"--out {args.out}: a .json file name")


def header(args: argparse.Namespace, cfg: RunConfig, overrides: list[str], device: torch.device) -> dict:
    """The result JSON before any figure: device, commit, overrides, speculation settings, arguments."""
    shipped = SpeculativeDecoding.from_config(
        None, dataclasses.replace(cfg.rollout, speculative="ngram")
    ).policy
    return {
        "benchmark": "spec_gpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": _gpu(device),
        "torch": torch.__version__,
        "git": _git(),
        "config": str(CONFIG.relative_to(REPO)),
        "overrides": overrides,
        "speculative": {  # as shipped: rollout.speculative_* defaults and the engine's SpecPolicy
            "modes_compared": ["off", "mtp"],
            "speculative_tokens": cfg.rollout.speculative_tokens,
            "speculative_max_batch": shipped.max_batch,
            "min_acceptance": shipped.min_acceptance,
            "acceptance_window_steps": shipped.window,
            "probe_every": shipped.probe_every,
        },
        "workload_args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tail_prompts": args.tail_prompts,
        "engine_args": {"uniform": uniform_engine_args(args), "tail": tail_engine_args(args)},
        "status": "started",
        "uniform": {},
        "tail": {},
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    overrides = config_overrides(args)
    cfg = load_config(CONFIG, overrides)  # ConfigError: one line, before any model is built
    if cfg.task.path and not Path(cfg.task.path).is_absolute():  # the config's data, from any folder
        overrides.append(f"task.path={REPO / cfg.task.path}")
        cfg = load_config(CONFIG, overrides)
    if args.tail_prompts == "gsm8k" and args.prompts > cfg.task.num_eval:
        raise SystemExit(
            f"spec_gpu: --prompts {args.prompts} > the {cfg.task.num_eval} held-out GSM8K prompts "
            "(task.num_eval); use fewer or --tail-prompts synthetic"
        )
    started = time.perf_counter()
    result = header(args, cfg, overrides, device)

    def save(status: str) -> None:
        result["status"] = status
        result["elapsed_s"] = time.perf_counter() - started
        write_json(args.out.stem, result, args.out.parent)

    model, tokenizer, task, result["sft"] = build_and_sft(cfg, args, device)
    save("sft done")
    print(summary_line(result, "sft"), flush=True)  # each figure's line as soon as it is known
    passes = dict(deadline=started + args.budget_s, on_pass=lambda: save("running"))
    uniform = [
        list(p) for p in random_prompts(tokenizer.vocab_size, args.uniform_batch, args.uniform_prompt_len)
    ]
    uniform_requests = sampling_requests(uniform, args.uniform_new, 1.0, "u")
    make = lambda: Engine(model, **uniform_engine_args(args))  # noqa: E731
    both_ways(model, cfg, make, uniform_requests, device, args.uniform_passes, result["uniform"], **passes)
    print(summary_line(result, "uniform"), flush=True)
    make = lambda: Engine(model, **tail_engine_args(args))  # noqa: E731
    tail = tail_requests(args, tokenizer, task)
    both_ways(model, cfg, make, tail, device, args.tail_passes, result["tail"], **passes)
    failed = [f"{w}/{m}" for w in ("uniform", "tail") for m in ("off", "mtp") if "error" in result[w][m]]
    save(f"complete, errors in {failed}" if failed else "complete")
    print(summary_line(result, "tail"), flush=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["status"] == "complete" else 1)
