#!/usr/bin/env bash
# One device call of the perfplan round (issues 23/24): run from a folder holding new/ (this branch's moerl
# and bench) and base/ (the issue-10 code, commit 0f58815), results under $OUT. Order = importance.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
STEPS=${STEPS:-"checks smoke engine percall_new percall_base decode_base"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/call.log"
for s in $STEPS; do
  echo "=== $s $(date -u +%T)" | tee -a "$OUT/call.log"
  case $s in
    checks) (cd "$ROOT/new" && PYTHONPATH=. python3 bench/gpu_checks.py --device cuda 2>&1 | grep -v "^ok " ) ;;
    smoke) (cd "$ROOT/new" && PYTHONPATH=. python3 bench/ep_smoke.py --device cuda --out-dir "$OUT" 2>&1) ;;
    engine) (cd "$ROOT/new" && PYTHONPATH=. python3 bench/ep_engine_gpu.py --device cuda --spec reference \
        --runs 2 --extra-batches 64 128 --out-dir "$OUT" 2>&1) ;;
    percall_new) (cd "$ROOT/new" && PYTHONPATH=. python3 bench/ep_percall.py --device cuda --label new \
        --out-dir "$OUT/pn" 2>&1) && mv "$OUT/pn/ep_percall.json" "$OUT/ep_percall_new.json" ;;
    percall_base) (cd "$ROOT/base" && PYTHONPATH=. python3 bench/ep_percall.py --device cuda --label base \
        --out-dir "$OUT/pb" 2>&1) && mv "$OUT/pb/ep_percall.json" "$OUT/ep_percall_base.json" ;;
    engine2) (cd "$ROOT/new" && PYTHONPATH=. python3 bench/ep_engine_gpu.py --device cuda --spec reference \
        --runs 2 --skip-ep --out-dir "$OUT/e2" 2>&1) && mv "$OUT/e2/ep_engine_gpu.json" "$OUT/ep_engine_gpu_2.json" ;;
    w1_base) (cd "$ROOT/base" && PYTHONPATH=. python3 bench/ep_decode_w1.py --device cuda --label base \
        --out-dir "$OUT/w1" 2>&1) && mv "$OUT/w1/ep_decode_w1.json" "$OUT/ep_decode_w1_base.json" ;;
    decode_base) (cd "$ROOT/base" && PYTHONPATH=. python3 bench/decode_points.py --device cuda --spec reference \
        --batches 64 128 --label base --out-dir "$OUT/db" 2>&1) && mv "$OUT/db/decode_points.json" "$OUT/decode_points_base.json" ;;
  esac 2>&1 | tee -a "$OUT/call.log"
done
rmdir "$OUT"/pn "$OUT"/pb "$OUT"/db "$OUT"/e2 "$OUT"/w1 2>/dev/null
echo "=== done $(date -u +%T)" | tee -a "$OUT/call.log"
