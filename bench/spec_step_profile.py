"""Where a speculative decode step's time goes (issue 49): the 1 B policy of ``configs/gpu_single.yaml``
with a fresh MTP module (no SFT: costs do not depend on what is accepted), a paged engine of ``--rows``
running sequences (random prompts, long responses, temperature 1), and for each row count and
``--tokens`` K:

- ``plain_ms``: host wall per plain decode step (the engine's own ``sync_every``), speculation off;
- ``spec_ms``: host wall per speculative step (``Engine.step`` with speculation forced on every step:
  ``SpecPolicy`` rules off), the step's host sync included;
- ``graph_ms``: device time of one replay of the speculative step's CUDA graph (CUDA events over
  ``--replays`` replays of the same key; the step is idempotent, so replaying it changes nothing);
- ``regions``: under ``torch.profiler``, the speculative step run eagerly: kernel time and kernel count
  of the draft (``MtpDrafter.draft_no_sync``), the verify forward, the accept rule (``verify_drafts``)
  and the MTP ring write, per step; plus ``graph_step``: kernel time and count per ``Engine.step`` with
  graphs on (kernels of graph replays included), and ``plain_step`` the same for plain steps;
- ``ops``: aten operators that launch a kernel (views and metadata ops left out), per plain step and per
  speculative step by part, counted by a ``TorchDispatchMode`` on eager steps: device-independent, so a
  CPU run (``--tiny``, or the full shape's layer count with ``--set model.num_layers=8``) shows what a
  change does to the kernel count of a step that, at decode batch sizes, costs about its launches.

    python3 bench/spec_step_profile.py --device cuda --out $OUT/spec_profile.json
    python3 bench/spec_step_profile.py --device cpu --tiny --out /tmp/spec_profile.json   # CPU check

Nothing here is a figure of the issue; it says which part of the step to make cheaper.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import write_json  # noqa: E402
from bench.spec_gpu import CONFIG, TINY_MODEL, _git, _gpu, _sync  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.models import build_model  # noqa: E402
from moerl.models.mtp import attach_fresh_mtp  # noqa: E402
from moerl.rollout import (  # noqa: E402
    Engine,
    Request,
    SamplingParams,
    spec_decode,  # noqa: E402
)
from moerl.rollout.spec_decode import SpeculativeDecoding  # noqa: E402
from moerl.rollout.speculative import MtpDrafter, SpecPolicy  # noqa: E402


def engine_for(model, rows: int, prompt_len: int, new: int, seed: int) -> Engine:
    buckets = [1 << i for i in range(12) if (1 << i) <= rows] + ([rows] if rows & (rows - 1) else [])
    return Engine(
        model,
        cache="paged",
        max_slots=rows,
        block_size=16,
        batch_buckets=sorted(set(buckets)),
        kv_token_budget=rows * (prompt_len + new + 64),
        seed=seed,
    )


def start(engine: Engine, rows: int, prompt_len: int, new: int, vocab: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in range(rows):
        ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(
            Request(
                request_id=f"r{i}",
                prompt_ids=ids,
                params=SamplingParams(temperature=1.0, max_new_tokens=new, n=1, seed=seed + i),
            )
        )
    while len(engine.scheduler.running) < rows:
        engine.step()


def forced_on(model, k: int) -> SpeculativeDecoding:
    """Speculation on every step: no batch, acceptance or cost rule, no plain probes."""
    pol = _AlwaysOn(max_batch=10**9, min_acceptance=0.0, probe_every=10**9)
    return SpeculativeDecoding(MtpDrafter(model), k, pol)


class _AlwaysOn(SpecPolicy):
    def is_slower(self) -> bool:  # the cost rule off
        return False


def wall_ms(engine: Engine, steps: int, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def graph_replay_ms(engine: Engine, spec: SpeculativeDecoding, replays: int, device) -> float | None:
    """Device ms of one replay of the newest speculative graph (None without graphs)."""
    g = spec.graphs
    if g is None or not g.is_enabled or not g.num_graphs or device.type != "cuda":
        return None
    graph, _ = g._graphs[g.keys[-1]]
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize(device)
    return a.elapsed_time(b) / replays


VIEW_OPS = frozenset(
    "view _unsafe_view reshape _reshape_alias unsqueeze squeeze slice select t transpose permute expand "
    "alias as_strided detach lift_fresh unbind split split_with_sizes chunk narrow diagonal unfold".split()
)
"""aten operators that launch no kernel (views, metadata): left out of ``OpCounter``'s counts."""


class OpCounter(TorchDispatchMode):
    """Kernel-launching aten operators, by the part of the step (``region``) that ran them."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other"
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEW_OPS:
            self.counts[self.region] = self.counts.get(self.region, 0) + 1
        return func(*args, **(kwargs or {}))


def ops_per_step(fn, steps: int, counter: OpCounter | None = None) -> dict:
    """Kernel-launching operators per call of ``fn`` (``steps`` calls, eager), in total and per region."""
    counter = counter or OpCounter()
    with counter:
        for _ in range(steps):
            fn()
    per = {n: c / steps for n, c in sorted(counter.counts.items())}
    return {"all": sum(per.values()), **per}


@contextlib.contextmanager
def labelled(spec: SpeculativeDecoding, counter: OpCounter | None = None):
    """The step's parts wrapped in ``record_function`` ranges (module functions and drafter methods),
    and attributed to their region in ``counter``."""
    saved = {n: getattr(spec_decode, n) for n in ("verify_forward_no_sync", "verify_drafts")}
    dr = spec.drafter

    def wrap(name, fn):
        def inner(*a, **kw):
            outer = counter.region if counter else None
            if counter:
                counter.region = name
            try:
                with torch.profiler.record_function(f"spec::{name}"):
                    return fn(*a, **kw)
            finally:
                if counter:
                    counter.region = outer

        return inner

    spec_decode.verify_forward_no_sync = wrap("verify", saved["verify_forward_no_sync"])
    spec_decode.verify_drafts = wrap("accept", saved["verify_drafts"])
    dr.draft_no_sync = wrap("draft", MtpDrafter.draft_no_sync.__get__(dr))
    dr.keep_no_sync = wrap("ring", MtpDrafter.keep_no_sync.__get__(dr))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(spec_decode, n, f)
        del dr.draft_no_sync, dr.keep_no_sync


def kernel_table(trace: dict, steps: int) -> dict:
    """Kernel ms and count per step: in total, and per ``spec::`` range (by launch correlation)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("name", "").startswith("spec::")
    )
    launch_ts = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    out: dict = {"all": [0.0, 0]}
    for e in ev:
        if e.get("cat") != "kernel":
            continue
        out["all"][0] += e["dur"] / 1e3
        out["all"][1] += 1
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        if ts is None:
            continue
        for lo, hi, name in ranges:
            if lo <= ts <= hi:
                slot = out.setdefault(name, [0.0, 0])
                slot[0] += e["dur"] / 1e3
                slot[1] += 1
                break
    return {n: {"kernel_ms": v[0] / steps, "kernels": v[1] / steps} for n, v in out.items()}


def profiled(fn, steps: int, device) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        table = kernel_table(json.loads(path.read_text()), steps)
    table["wall_ms_profiled"] = wall
    return table


def one_case(model, args, rows: int, k: int, device) -> dict:
    vocab = model.config.vocab_size
    res: dict = {"rows": rows, "k": k}
    plain = engine_for(model, rows, args.prompt_len, args.new, args.seed)
    start(plain, rows, args.prompt_len, args.new, vocab, args.seed)
    wall_ms(plain, args.warm_steps, device)
    res["plain_ms"] = statistics.median(wall_ms(plain, args.steps, device) for _ in range(3))
    res["plain_step"] = profiled(plain.step, args.profile_steps, device)
    graphs, plain._graphs = plain._graphs, None  # eager: every operator dispatched
    res["ops"] = {"plain": ops_per_step(plain.step, args.profile_steps)}
    plain._graphs, plain = graphs, None
    eng = engine_for(model, rows, args.prompt_len, args.new, args.seed)
    spec = eng.speculation = forced_on(model, k)
    start(eng, rows, args.prompt_len, args.new, vocab, args.seed)
    wall_ms(eng, args.warm_steps, device)
    caps = spec.graphs.num_captures if spec.graphs else 0
    res["spec_ms"] = statistics.median(wall_ms(eng, args.steps, device) for _ in range(3))
    res["spec_captures_while_timed"] = (spec.graphs.num_captures if spec.graphs else 0) - caps
    res["tokens_per_row_step"] = (spec.num_accepted + spec.policy.num_spec_steps * rows) / max(
        1, spec.policy.num_spec_steps * rows
    )
    res["graph_ms"] = graph_replay_ms(eng, spec, args.replays, device)
    res["graph_step"] = profiled(eng.step, args.profile_steps, device)
    graphs, spec.graphs = spec.graphs, None  # eager: the parts' kernels attributed to their ranges
    with labelled(spec):
        res["eager_step"] = profiled(eng.step, args.profile_steps, device)
    counter = OpCounter()
    with labelled(spec, counter):
        res["ops"]["spec"] = ops_per_step(eng.step, args.profile_steps, counter)
    spec.graphs = graphs
    return res


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=Path("/tmp/spec_profile.json"))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--tokens", default="1,2,3")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--warm-steps", type=int, default=24)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help="a config override after the tiny shape's (e.g. model.num_layers=8)")  # fmt: skip
    args = p.parse_args(argv)
    if args.tiny:
        args.new, args.warm_steps, args.steps, args.profile_steps, args.prompt_len = 200, 4, 4, 2, 16
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    overrides = [f"model.device={args.device}", "model.max_position_embeddings=4096"]
    overrides += (list(TINY_MODEL) if args.tiny else []) + args.sets
    cfg = load_config(CONFIG, overrides)
    torch.manual_seed(0)
    from moerl.tasks.tokenizer import load_run_tokenizer

    tok = load_run_tokenizer(cfg)
    model = attach_fresh_mtp(build_model(cfg.model, tok.vocab_size)).eval()
    out = {"benchmark": "spec_step_profile", "device": _gpu(device), "git": _git(), "overrides": overrides,
           "args": {k: str(v) for k, v in vars(args).items()}, "cases": []}  # fmt: skip
    for rows in (int(x) for x in args.rows.split(",")):
        for k in (int(x) for x in args.tokens.split(",")):
            try:
                case = one_case(model, args, rows, k, device)
            except Exception as e:  # noqa: BLE001 -- recorded; the other cases still run
                case = {"rows": rows, "k": k, "error": f"{type(e).__name__}: {e}"}
            out["cases"].append(case)
            write_json(args.out.stem, out, args.out.parent)
            brief = {n: case.get(n) for n in ("rows", "k", "plain_ms", "spec_ms", "graph_ms", "error")}
            parts = {n: round(v["kernel_ms"], 3) for n, v in case.get("eager_step", {}).items()
                     if isinstance(v, dict)}  # fmt: skip
            ops = {n: v.get("all") for n, v in case.get("ops", {}).items()}
            print(f"[spec_profile] {brief} eager kernel ms {parts} ops/step {ops}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
