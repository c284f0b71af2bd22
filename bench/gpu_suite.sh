#!/usr/bin/env bash
# The one script a device call runs: environment facts, every one-GPU benchmark, then the summary table.
#
#   bench/gpu_suite.sh quick   # first call: reference widths, 4 layers for rollout/training, short HF generate
#   bench/gpu_suite.sh full    # the reference figures (16 layers, B=256, 128+128 tokens)
#   bench/gpu_suite.sh short   # full-size benchmarks, fewer repeats, no profiles (when little device time is left)
#   BASE=/path/of/an/older/checkout bench/gpu_suite.sh perf   # issue 24's figures: EP smoke, MoE layer,
#       decode, training at batches 8/24/32/40, then EP smoke, decode and training of $BASE alongside
#   bench/gpu_suite.sh e2e     # issue 32: real `moerl train` runs (1 B and 6.9 B, sync and async) against
#       their engine and trainer alone (bench/e2e_gpu.py; E2E_ARGS="--sizes 1b --modes sync" for a subset;
#       async needs Ray: `source .ray/activate` first)
#
# Each benchmark runs in its own process (a failure or an out-of-memory error stays there) under a
# timeout; JSON results and suite.log go to $OUT (default bench/results). The summary is printed last.
set -u -o pipefail
MODE=${1:-full}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG="$OUT/suite.log"
{
  echo "== env $(date -u +%FT%TZ) mode=$MODE"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version \
    --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$LOG"

bench() {  # bench SECONDS SCRIPT ARGS...
  local limit=$1
  shift
  echo "== $* ($(date -u +%T))" | tee -a "$LOG"
  timeout "$limit" python3 "$@" --device cuda --out-dir "$OUT" 2>&1 | tee -a "$LOG"
  echo "rc=$? ($(date -u +%T))" | tee -a "$LOG"
}

if [ "$MODE" = e2e ]; then  # one long child per size and mode; the script has its own per-run timeouts
  echo "== bench/e2e_gpu.py ${E2E_ARGS:-} ($(date -u +%T))" | tee -a "$LOG"
  python3 bench/e2e_gpu.py --device cuda --out-dir "$OUT" ${E2E_ARGS:-} 2>&1 | tee -a "$LOG"
  echo "rc=$? ($(date -u +%T))" | tee -a "$LOG"
  exit 0
fi
bench 120 bench/gpu_checks.py
if [ "$MODE" = perf ]; then
  bench 90 bench/ep_smoke.py
  bench 90 bench/moe_layer.py --spec reference --tokens 16384
  bench 200 bench/rollout_gpu.py --spec reference --batch 256 --prompt-len 128 --new-tokens 128 --runs 2
  bench 200 bench/train_step.py --spec reference --batches 8,24,32,40 --seq-len 1024 --steps 2
  if [ -n "${BASE:-}" ]; then  # the same figures of an older checkout, in the same call
    mkdir -p "$OUT/base"
    for args in "ep_smoke.py" "rollout_gpu.py --spec reference --batch 256 --prompt-len 128 --new-tokens 128 --runs 2 --no-baseline" \
      "train_step.py --spec reference --batches 24,32 --seq-len 1024 --steps 2 --no-baseline"; do
      echo "== baseline ($BASE): $args ($(date -u +%T))" | tee -a "$LOG"
      (cd "$BASE" && PYTHONPATH=. timeout 150 python3 bench/$args --device cuda --out-dir "$OUT/base") 2>&1 | tee -a "$LOG"
    done
  fi
elif [ "$MODE" = short ]; then
  bench 150 bench/rollout_gpu.py --spec reference --batch 256 --prompt-len 128 --new-tokens 128 --runs 2
  bench 150 bench/train_step.py --spec reference --batches 8,16,24,32 --seq-len 1024 --steps 2
  bench 60 bench/moe_layer.py --spec reference --tokens 16384
elif [ "$MODE" = quick ]; then
  bench 120 bench/moe_layer.py --spec reference --tokens 16384
  bench 180 bench/rollout_gpu.py --spec reference4 --batch 256 --prompt-len 128 --new-tokens 128 --runs 2 \
    --hf-new-tokens 16 --profile-steps 8
  bench 150 bench/train_step.py --spec reference4 --batches 8,16 --seq-len 1024 --steps 2 --profile
  bench 60 bench/ep_smoke.py
else
  bench 120 bench/moe_layer.py --spec reference --tokens 16384
  bench 240 bench/rollout_gpu.py --spec reference --batch 256 --prompt-len 128 --new-tokens 128 --runs 3 \
    --profile-steps 4
  bench 180 bench/train_step.py --spec reference --batches 8,16,24,32 --seq-len 1024 --steps 3 --profile
  bench 40 bench/ep_smoke.py
fi
python3 bench/summarize.py "$OUT" 2>&1 | tee -a "$LOG"
