#!/usr/bin/env bash
# One device call: issue 49's GPU figure (bench/spec_gpu.py, one process: the 1 B policy of
# configs/gpu_single.yaml with its MTP module, a short SFT of both, then the long-tail and uniform B=256
# workloads with rollout.speculative off and mtp). Run from the repository root:
#   OUT=/some/dir bash bench/spec_call.sh                  # on one H100/H200 (budget: 420 s, < 70 GB)
#   DEVICE=cpu OUT=/tmp/spec bash bench/spec_call.sh --tiny  # the same call on CPU at the tiny shape
# Extra arguments go to bench/spec_gpu.py. Files under $OUT (3), each there as soon as it exists:
#   call.log       the GPU (nvidia-smi), the commit, one [spec_gpu] line per figure, the exit status
#   spec_gpu.json  the figures, rewritten by the script after the SFT and after every timed pass
#   spec_gpu.log   the script's whole output
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
LOG="$OUT/call.log"
{ nvidia-smi --query-gpu=name,memory.total,clocks.current.sm,clocks.max.sm,memory.used --format=csv,noheader \
    2>/dev/null || echo "nvidia-smi: none"; } | tee "$LOG"
{ git log --oneline -1 2>/dev/null || echo "git: none"; } | tee -a "$LOG"
echo "=== spec_gpu $(date -u +%T) device=$DEVICE timeout=${TIMEOUT_S:-420}s" | tee -a "$LOG"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "${TIMEOUT_S:-420}" \
  python3 -u bench/spec_gpu.py --device "$DEVICE" --out "$OUT/spec_gpu.json" "$@" 2>&1 | tee "$OUT/spec_gpu.log"
rc=${PIPESTATUS[0]}
grep '^\[spec_gpu\]' "$OUT/spec_gpu.log" >> "$LOG"
[ "$rc" -eq 0 ] || tail -5 "$OUT/spec_gpu.log" >> "$LOG"
echo "=== end $(date -u +%T) rc=$rc (124: the timeout; spec_gpu.json keeps every finished pass)" | tee -a "$LOG"
exit "$rc"
