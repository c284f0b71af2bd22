#!/usr/bin/env bash
# The perf2 device call (issue 24, EP world size 1 host work): run from a folder holding new/ (this
# branch's moerl and bench) and base/ (the merged perfplan code, commit 7970169, with this branch's
# bench/ep_smoke.py so both take the same median of 6 interleaved timings). Results under $OUT.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/s"
ROOT=$(pwd)
STEPS=${STEPS:-"smoke_new checks smoke_base smoke_new2 smoke_base2 host_new host_base"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/call.log"
smoke() {  # $1 = new|base, $2 = json name
  (cd "$ROOT/$1" && mkdir -p "$OUT/s" && PYTHONPATH=. timeout 120 python3 bench/ep_smoke.py --device cuda \
    --out-dir "$OUT/s" 2>&1) && mv "$OUT/s/ep_smoke.json" "$OUT/$2.json"
}
for s in $STEPS; do
  echo "=== $s $(date -u +%T)" | tee -a "$OUT/call.log"
  case $s in
    checks) (cd "$ROOT/new" && PYTHONPATH=. timeout 150 python3 bench/gpu_checks.py --device cuda 2>&1 | grep -v "^ok ") ;;
    smoke_new) smoke new ep_smoke_new ;;
    smoke_new2) smoke new ep_smoke_new2 ;;
    smoke_base) smoke base ep_smoke_base ;;
    smoke_base2) smoke base ep_smoke_base2 ;;
    host_new|host_base) v=${s#host_}; (cd "$ROOT/$v" && PYTHONPATH=. timeout 60 python3 bench/ep_host.py \
        --label "$v" --out-dir "$OUT/s" 2>&1 | grep -v "ops after") && mv "$OUT/s/ep_host.json" "$OUT/ep_host_$v.json" ;;
  esac 2>&1 | tee -a "$OUT/call.log"
done
rmdir "$OUT/s" 2>/dev/null
echo "=== done $(date -u +%T)" | tee -a "$OUT/call.log"
