#!/usr/bin/env bash
# One device call for issue 33's long-tail figure (paged vs slot engine at the same KV memory) and the
# paged engine's checks: the CUDA fast paths' checks (gpu_checks.py), kernel vs definition, the uniform
# B=256 benchmark, a per-kernel profile, and this tree's paged engine against a base tree's (BASE,
# default .cache/base: `git archive <commit> moerl bench | tar -x -C .cache/base`, carried to the device)
# on the same workload. Results under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:-.cache/base}
STEPS=${STEPS:-"attn tail tail_engine kprof uniform"}
TAIL="--config reference --prompts 32 --group 8 --prompt-len 512 --median-new 300 --max-new 8192
  --kv-slots 32 --max-slots 512 --sync-every 8 --device cuda --dtype bfloat16"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/call.log"
for s in $STEPS; do
  echo "=== $s $(date -u +%T)" | tee -a "$OUT/call.log"
  case $s in
    checks) PYTHONPATH=. timeout 200 python3 bench/gpu_checks.py --device cuda 2>&1 | tail -45 ;;
    attn) PYTHONPATH=. timeout 150 python3 bench/paged_attention_gpu.py --out "$OUT/paged_attention_gpu.json" 2>&1 | tail -12 ;;
    tail) PYTHONPATH=. timeout 300 python3 bench/paged_kv.py $TAIL --engines slots,paged --passes 2 \
            --out "$OUT/paged_kv_gpu.json" 2>&1 | grep -v "^slots: \|^paged: " | tail -6 ;;
    tail_engine) PYTHONPATH=. timeout 300 python3 bench/paged_kv.py $TAIL --engines slots,paged --passes 2 \
            --buckets engine --busy --out "$OUT/paged_kv_gpu_engine_buckets.json" 2>&1 | grep -v "^slots: \|^paged: " | tail -6 ;;
    base) (cd "$BASE" && PYTHONPATH=. timeout 150 python3 bench/paged_kv.py $TAIL --engines paged --passes 2 \
            --out "$OUT/paged_kv_gpu_base.json" 2>&1 | grep -v "^paged: " | tail -3) ;;
    kprof) PYTHONPATH=. timeout 150 python3 bench/paged_kv.py $TAIL --engines paged \
            --kernel-profile 100,400,1200,2000,2600 --out "$OUT/paged_kv_gpu_kernels.json" 2>&1 | tail -2 ;;
    uniform) PYTHONPATH=. timeout 200 python3 bench/rollout_gpu.py --spec reference --batch 256 --prompt-len 128 \
            --new-tokens 128 --runs 2 --no-baseline --kv-cache paged --device cuda --out-dir "$OUT" 2>&1 | tail -4 ;;
  esac
done
echo "=== end $(date -u +%T)" | tee -a "$OUT/call.log"
