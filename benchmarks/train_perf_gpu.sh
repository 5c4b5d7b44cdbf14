#!/usr/bin/env bash
# One device call's worth of training-throughput measurement (issue 17), run from the repository
# root on the GPU machine; everything lands in $OUT (or ./perf_out):
#
#   bash benchmarks/train_perf_gpu.sh [BASE_TREE]
#
# 1. `small` at T=8192, B=1: bench_train.py --impls xla,best, with a profile of each impl, and
#    the trace breakdown of the best impl;
# 2. `v4-flash-layer` at T=8192, B=1: the best impl, its profile and breakdown;
# 3. with BASE_TREE (an older checkout, e.g. `git archive 812c491`), `small` best there too, in
#    the same call, as the before figure.
# Each part has its own time limit so that one failure leaves the others' results.
set -u
OUT=$(realpath -m "${OUT:-perf_out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PY:-python3}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true

run() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" >> "$OUT/log.txt" 2>&1 || echo "$name: exit $?" | tee -a "$OUT/log.txt"
}

run small 300 $PY -m benchmarks.bench_train --preset small --seq-len 8192 --batch-size 1 \
  --impls xla,best --profile /tmp/prof_small --out "$OUT/train_small_T8192.json"
best=$(ls -t /tmp/prof_small 2>/dev/null | head -1)
[ -n "$best" ] && run small-breakdown 120 $PY -m benchmarks.trace_breakdown "/tmp/prof_small/$best" \
  --top 25 --json "$OUT/breakdown_small_$best.json"
run flash 300 $PY -m benchmarks.bench_train --preset v4-flash-layer --seq-len 8192 \
  --batch-size 1 --impls best --profile /tmp/prof_flash --out "$OUT/train_flash_T8192.json"
best=$(ls -t /tmp/prof_flash 2>/dev/null | head -1)
[ -n "$best" ] && run flash-breakdown 120 $PY -m benchmarks.trace_breakdown "/tmp/prof_flash/$best" \
  --top 25 --json "$OUT/breakdown_flash_$best.json"
if [ -n "${1:-}" ]; then
  # (the before tree may predate benchmarks/ as a package: run the script by path there)
  (cd "$1" && PYTHONPATH=$PWD run base-small 240 $PY benchmarks/bench_train.py --preset small \
    --seq-len 8192 --batch-size 1 --impls best --out "$OUT/train_small_T8192_base.json")
fi
grep -h -A4 "^| preset" "$OUT/log.txt"
grep -h -B1 -A16 "^| family" "$OUT/log.txt"
