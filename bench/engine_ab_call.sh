#!/usr/bin/env bash
# One device call: this tree's rollout engine against a base tree's (issue 52: "no speed lost, GPU uniform and
# long-tail figures within 3%, same call"), then the CUDA fast paths' checks. BASE (default .cache/base) holds
# the base commit's moerl/ and bench/: `git archive <commit> moerl bench | tar -x -C .cache/base`, carried.
# Order: uniform base, uniform this, tail base, tail this, checks; each JSON lands under $OUT when done.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; BASE=${BASE:-.cache/base}; HERE=$PWD
UNIFORM="--spec reference --batch 256 --prompt-len 128 --new-tokens 128 --runs ${RUNS:-5} --no-baseline
  --kv-cache paged --device cuda"
TAIL="--config reference --prompts 32 --group 8 --prompt-len 512 --median-new 300 --max-new 8192
  --kv-slots 32 --max-slots 512 --sync-every 8 --device cuda --dtype bfloat16 --engines paged --passes 2"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/call.log"
(cat "$BASE/COMMIT" 2>/dev/null; git log --oneline -1) | tee -a "$OUT/call.log"
step() {  # name, tree, command...
  local name=$1 tree=$2; shift 2
  echo "=== $name $(date -u +%T)" | tee -a "$OUT/call.log"
  (cd "$tree" && PYTHONPATH=. "$@" 2>&1 | tail -4 | tee -a "$OUT/call.log")
}
step uniform_base "$BASE" timeout 120 python3 bench/rollout_gpu.py $UNIFORM --out-dir "$OUT/uniform_base"
step uniform_this "$HERE" timeout 120 python3 bench/rollout_gpu.py $UNIFORM --out-dir "$OUT/uniform_this"
step tail_base "$BASE" timeout 150 python3 bench/paged_kv.py $TAIL --out "$OUT/tail_base.json"
step tail_this "$HERE" timeout 150 python3 bench/paged_kv.py $TAIL --out "$OUT/tail_this.json"
python3 - "$OUT" <<'PY' | tee -a "$OUT/call.log"
import glob, json, sys
out = sys.argv[1]
def uni(tree):
    f = glob.glob(f"{out}/uniform_{tree}/*.json")
    return json.load(open(f[0]))["results"]["moerl"]["tokens_per_s"] if f else None
def tail(tree):
    try:
        return json.load(open(f"{out}/tail_{tree}.json"))["results"]["paged"]["pass2"]["tokens_per_s"]
    except (OSError, KeyError):
        return None
for name, fn in (("uniform B=256", uni), ("long tail", tail)):
    b, t = fn("base"), fn("this")
    print(f"[ab] {name}: base {b} this {t} ratio {t / b:.3f}" if b and t else f"[ab] {name}: base {b} this {t}")
PY
step checks "$HERE" timeout 200 python3 bench/gpu_checks.py --device cuda
echo "=== end $(date -u +%T)" | tee -a "$OUT/call.log"
