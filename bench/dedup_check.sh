#!/usr/bin/env bash
# One-GPU check of the dedup fold (branch dedup): the code it touched runs on CUDA as before.
#
#   OUT=/some/dir bench/dedup_check.sh      # from the repository root; about 3-5 minutes on an H200
#
# Steps (each in its own process, under a timeout, all of them inside a BUDGET of seconds):
#   pytest      tests/unit/test_ep_single_rank.py: the NCCL test of both dispatchers on one GPU (the
#               Triton row kernels of moerl/ep/rows.py in dispatch/combine/backward, the dispatchers'
#               _build_links); it must run, not skip
#   gpu_checks  bench/gpu_checks.py: every Triton kernel (rows.gather_sum2 and its backward,
#               rows.single_rank_layout, ...) against its tensor-op reference
#   rollout_gpu, r3_gpu, moe_layer, train_step, ep_engine_gpu, ep_smoke: the benchmarks whose code was
#               folded, at their small sizes on CUDA, then their JSON read back and sanity-checked
# A step that fails is reported and the next one still runs. Logs and JSON files go to $OUT; a
# PASS/FAIL line per step and a summary are printed last; the exit status is the number of failures.
set -u -o pipefail
OUT=${OUT:-bench/results/dedup_check}
BUDGET=${BUDGET:-320}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
START=$(date +%s)
SUMMARY=()
FAILS=0

{
  echo "== env $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton, transformers, pytest; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'triton', triton.__version__, \
'transformers', transformers.__version__, 'pytest', pytest.__version__)" 2>&1
} | tee "$OUT/env.log"

record() {  # record NAME STATUS DETAIL
  SUMMARY+=("$2 $1${3:+: $3}")
  [ "$2" = PASS ] || FAILS=$((FAILS + 1))
}

step() {  # step NAME LIMIT_S CMD... ; output in $OUT/NAME.log, the last lines printed
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then
    record "$name" "NOT-RUN" "time budget ($BUDGET s) spent"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name ($(date -u +%T), limit ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 12 "$OUT/$name.log"
  if [ "$rc" -eq 0 ]; then
    echo "-- $name rc=0 in $(($(date +%s) - t0)) s"
    return 0
  fi
  record "$name" FAIL "rc=$rc after $(($(date +%s) - t0)) s (124 = timeout; see $OUT/$name.log)"
  return 1
}

verify() {  # verify NAME: read $OUT/NAME.json back and check what the fold must keep
  local msg
  if msg=$(python3 - "$OUT" "$1" 2>&1 <<'EOF'
import json, math, sys
from pathlib import Path

out, name = Path(sys.argv[1]), sys.argv[2]
d = json.loads((out / f"{name}.json").read_text())
assert d.get("benchmark") == name, f"benchmark field {d.get('benchmark')!r}"
assert str(d.get("device", "")).lower() not in ("", "cpu"), f"ran on {d.get('device')!r}, not a GPU"
fin = lambda v: isinstance(v, (int, float)) and math.isfinite(v)
if name == "moe_layer":
    a = d["agreement_vs_float32"]
    for impl in ("moerl", "moerl-reference"):
        assert a[impl]["out"] < 0.1 and a[impl]["grad_x"] < 0.1, f"{impl} vs float32: {a[impl]}"
    assert a["transformers_vs_moerl_out"] < 0.1, a["transformers_vs_moerl_out"]
    assert all(r["fwd_bwd"]["median_ms"] > 0 for r in d["results"].values())
    info = f"moerl out err {a['moerl']['out']:.2e}"
elif name == "train_step":
    r = d["results"]
    assert "error" not in r["transformers/b2"], r["transformers/b2"]
    m = r["moerl/b2"]
    assert m["tokens_per_s"] > 0 and all(fin(g) for g in m["grad_norms"]), m
    info = f"moerl {m['tokens_per_s']:.0f} tok/s, grad norms {m['grad_norms']}"
elif name == "rollout_gpu":
    r, a = d["results"], d["agreement"]
    want = d["batch"] * d["new_tokens"]
    assert r["moerl"]["tokens"] == want and r["transformers"]["tokens"] == want, (r["moerl"]["tokens"], want)
    assert a["logits"]["fast_vs_reference_same_routing"] < 0.1, a["logits"]
    lp = a["engine_vs_trainer_logprobs"]
    assert fin(lp["max_abs_diff"]) and lp["mean_abs_diff"] < 0.5, lp
    assert d["decode_profile_eager"], "no decode profile rows"
    g = a["graphs_vs_eager_greedy"]
    info = (f"{r['moerl']['tokens_per_s']:.0f} tok/s, logprob mean |d| {lp['mean_abs_diff']:.4f}, "
            f"graphs {r['moerl']['cuda_graphs']}, graphs vs eager {g}")
elif name == "r3_gpu":
    a, dc = d["agreement"], d["decode"]
    want = d["batch"] * d["new_tokens"]
    assert a["tokens"] == want and a["r3"]["expert_choices_differing"] == 0, a
    assert dc["off"]["tokens"] == dc["on"]["tokens"] == want and dc["on_over_off"] > 0, dc
    info = (f"r3 mean |d| {a['r3']['mean_abs_diff']:.4f}, off {a['off']['mean_abs_diff']:.4f}, "
            f"graph replays {dc['on']['cuda_graph_replays']}")
elif name == "ep_engine_gpu":
    dec = d["decode"]
    assert {"engine/graphs", "engine/eager", "ep1 alltoall/graphs", "ep1 hierarchical/eager"} <= set(dec), list(dec)
    assert all(v["tokens_per_s"] > 0 and v["tokens"] == d["batch"] * d["new_tokens"]
               for k, v in dec.items() if "B=" not in k), dec
    info = ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in dec.items())
elif name == "ep_smoke":
    r = d["results"]
    for k in ("AllToAllDispatcher", "HierarchicalDispatcher"):
        assert r[k]["out_rel_err"] < 0.1 and r[k]["grad_x_rel_err"] < 0.1, (k, r[k])
    assert d["backend"] == "nccl", d["backend"]
    info = ", ".join(f"{k} out err {v['out_rel_err']:.2e}" for k, v in r.items())
print(info)
EOF
  ); then
    record "$1" PASS "$msg"
  else
    record "$1" FAIL "$(echo "$msg" | tail -n 3 | tr '\n' ' ')"
  fi
}

# 1. The GPU tests: the NCCL test of both dispatchers must run (a skip means no GPU was seen).
if step pytest 120 python3 -m pytest -q -x -rs -p no:cacheprovider tests/unit/test_ep_single_rank.py; then
  if grep -q "SKIPPED" "$OUT/pytest.log"; then
    record pytest FAIL "a test was skipped: $(grep SKIPPED "$OUT/pytest.log" | head -n 2 | tr '\n' ' ')"
  else
    record pytest PASS "$(tail -n 1 "$OUT/pytest.log")"
  fi
fi
# 2. Every fast-path kernel against its reference (exits non-zero on any FAIL line).
step gpu_checks 150 python3 bench/gpu_checks.py --device cuda --out-dir "$OUT" &&
  record gpu_checks PASS "$(grep -c '^ok' "$OUT/gpu_checks.log") checks ok, $(grep -c '^FAIL' "$OUT/gpu_checks.log") failed"
# 3. The folded benchmarks at small sizes (tiny model unless said).
step rollout_gpu 120 python3 bench/rollout_gpu.py --device cuda --runs 2 --profile-steps 2 --out-dir "$OUT" &&
  verify rollout_gpu
step r3_gpu 90 python3 bench/r3_gpu.py --device cuda --runs 2 --out-dir "$OUT" && verify r3_gpu
step moe_layer 90 python3 bench/moe_layer.py --device cuda --tokens 1024 --iters 3 --out-dir "$OUT" &&
  verify moe_layer
step train_step 90 python3 bench/train_step.py --device cuda --steps 2 --out-dir "$OUT" && verify train_step
step ep_engine_gpu 120 python3 bench/ep_engine_gpu.py --device cuda --batch 4 --prompt-len 8 --new-tokens 8 \
  --runs 1 --extra-batches 2 --out-dir "$OUT" && verify ep_engine_gpu
step ep_smoke 90 python3 bench/ep_smoke.py --device cuda --tokens 1024 --hidden 1024 --inter 512 \
  --out-dir "$OUT" && verify ep_smoke

echo
echo "== dedup_check summary ($(($(date +%s) - START)) s, $(date -u +%T))"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
if [ "$FAILS" -eq 0 ]; then echo "ALL PASS"; else echo "FAILED: $FAILS step(s)"; fi
exit "$FAILS"
