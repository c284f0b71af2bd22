#!/usr/bin/env bash
# One device call for issue 47's end-to-end figures, in order of what a cut call must still bring back:
#   1. the issue's own user run (configs/gpu_single.yaml, 1 B, sft.steps=1, nothing else changed but
#      trainer.steps and output_dir) in sync and async mode: per-step timing/publish_s and the store's versions;
#   2. bench/e2e_gpu.py on the shipped configs (SIZES, MODES).
# Each result is copied under $OUT as soon as it exists (a call cut by its time limit still returns them).
# Needs Ray on the device: carry .ray (bash ../shared/tools/device_ray.sh).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/e2e_call; mkdir -p $W
SIZES=${SIZES:-1b,6.9b}; MODES=${MODES:-sync,async}; USER_STEPS=${USER_STEPS:-12}
USER_MODES=${USER_MODES:-sync async}; USER_TIMEOUT=${USER_TIMEOUT:-240}; E2E_TIMEOUT=${E2E_TIMEOUT:-560}
source .ray/activate
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,memory.used --format=csv | tee $OUT/gpu.txt
echo "${BENCH_GIT:-$(git log --oneline -1 2>/dev/null)}" > $OUT/git.txt
summarize() {  # the user run's per-step publish seconds and its store's versions, one line
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
p = [r["timing/publish_s"] for r in rows]
g = [r.get("timing/gen_s") for r in rows]
t = [r.get("timing/train_s") for r in rows]
print(f"[user {sys.argv[2]}] steps={len(rows)} publish_s median={statistics.median(p):.4f} "
      f"per step={[round(x, 4) for x in p]} gen_s={[round(x or 0, 2) for x in g]} train_s={[round(x or 0, 2) for x in t]}")
PY
}
for mode in $USER_MODES; do
  timeout -k 10 $USER_TIMEOUT python3 -m moerl.cli train --config configs/gpu_single.yaml --set runtime.mode=$mode \
    --set sft.steps=1 --set trainer.steps=$USER_STEPS --set output_dir=$W/user > $OUT/user_$mode.log 2>&1
  echo "user_${mode}_rc=$?" | tee -a $OUT/rc.txt
  d=$(ls -td $W/user/*/ | head -1)
  cp $d/metrics.jsonl $OUT/user_$mode.metrics.jsonl; cp $d/summary.json $OUT/user_$mode.summary.json
  ls $d/weights > $OUT/user_$mode.store.txt 2>&1; echo "[user $mode] store: $(tr '\n' ' ' < $OUT/user_$mode.store.txt)"
  summarize $OUT/user_$mode.metrics.jsonl $mode 2>&1 | tee -a $OUT/user_summary.txt
  rm -rf $W/user
done
timeout -k 10 $E2E_TIMEOUT python3 bench/e2e_gpu.py --device cuda --sizes $SIZES --modes $MODES \
  --out-dir $OUT --work-dir $W/work > $OUT/e2e.log 2>&1
echo "e2e_rc=$?" | tee -a $OUT/rc.txt
grep "^\[e2e\]" $OUT/e2e.log | cut -c1-1500
