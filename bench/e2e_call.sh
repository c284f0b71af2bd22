#!/usr/bin/env bash
# One device call for issue 47's end-to-end figures: bench/e2e_gpu.py on the shipped configs (sizes and modes
# below), then the issue's own user run (configs/gpu_single.yaml, 1 B, sync.steps=1 warm start, nothing else
# changed but steps) in sync and async mode, its per-step timing/publish_s and the versions its store holds.
# The e2e part runs in the background (setsid) so that a second call can wait for what the first did not
# (WAIT=1: only wait and collect). Results under $OUT. Needs Ray: carry .ray (bash ../shared/tools/device_ray.sh).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/e2e_call; mkdir -p $W
SIZES=${SIZES:-1b,6.9b}; MODES=${MODES:-sync,async}; USER_STEPS=${USER_STEPS:-12}; LIMIT=${LIMIT:-560}
source .ray/activate
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
if [ -z "$WAIT" ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,memory.used --format=csv | tee $W/gpu.txt
  git log --oneline -1 > $W/git.txt 2>/dev/null || true
  setsid nohup bash -c "
    python3 bench/e2e_gpu.py --device cuda --sizes $SIZES --modes $MODES --out-dir $W/results --work-dir $W/work \
      > $W/e2e.log 2>&1; echo e2e_rc=\$? >> $W/e2e.log
    for mode in ${USER_MODES:-sync async}; do
      python3 -m moerl.cli train --config configs/gpu_single.yaml --set runtime.mode=\$mode --set sft.steps=1 \
        --set trainer.steps=$USER_STEPS --set output_dir=$W/user > $W/user_\$mode.log 2>&1
      echo user_\${mode}_rc=\$? >> $W/e2e.log
      d=\$(ls -td $W/user/*/ | head -1); cp \$d/metrics.jsonl $W/user_\$mode.metrics.jsonl; cp \$d/summary.json $W/user_\$mode.summary.json
      ls \$d/weights > $W/user_\$mode.store.txt 2>&1; rm -rf \$d/weights \$d/policy \$d/checkpoints \$d/sft
    done
    echo all_done >> $W/e2e.log" > /dev/null 2>&1 &
fi
t0=$(date +%s)
while ! grep -q all_done $W/e2e.log 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt $LIMIT ]; do sleep 5; done
grep "^\[e2e\]\|_rc=\|all_done" $W/e2e.log | cut -c1-1500
(cd $W && tar czf $OUT/e2e_call.tgz --exclude='*/init/*' --exclude='*/runs/*' --exclude='*/user/*' . 2>/dev/null)
cp $W/results/*.json $OUT/ 2>/dev/null; ls -la $OUT
