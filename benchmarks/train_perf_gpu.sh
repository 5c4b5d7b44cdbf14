#!/usr/bin/env bash
# Training-throughput measurement on one GPU (issue 17's runner), from the repository root on the
# GPU machine; everything lands in $OUT (or ./perf_out):
#
#   bash benchmarks/train_perf_gpu.sh [BASE_TREE]
#
# Parts (PARTS, a comma list; default "small,flash", what this script ran before it had parts):
#   small   bench_train --preset $PRESET (small) at T=$SEQ (8192), B=1, --impls $IMPLS (xla,best),
#           $STEPS timed steps after $WARMUP (bench_train's 10 / 3), with a profile of each impl
#           and the trace breakdown of the newest one; VARIANTS adds bench_train --variants
#           (e.g. 'dq:config.interm=dq') and profiles them too;
#   flash   the same for the `v4-flash-layer` preset, --impls best;
#   probe   train_ops_probe at $PRESET's shapes: PROBE_ONLY (comma list of probe names; empty = all),
#           PROBE_VARIANTS ('NAME:k=v,...; ...' overrides of $PROBE_IMPL's Config, default
#           pallas_triton), PROBE_RATIOS (4,128,0), each attention probe checked against xla,
#           median of 10, stops starting probes after PROBE_S (60) seconds;
#   with BASE_TREE (an older checkout, e.g. `git archive 812c491`), `small` best there too, in
#   the same call, as the before figure.
# Each part has its own time limit so that one failure leaves the others' results.
#
# The per-round scripts that docs/perf/train_h200.md cites (train3_r1.sh ... train4_r3.sh) were
# removed in favour of this one; their exact commands stay in that page with their commits.
# Examples:  PARTS=small IMPLS=best STEPS=5 WARMUP=1 bash benchmarks/train_perf_gpu.sh
#            PARTS=probe PROBE_ONLY=attn_cr4_default_bwd,attn_cr4_r32_bwd \
#              PROBE_VARIANTS='r32:block_r=32' bash benchmarks/train_perf_gpu.sh
set -u
OUT=$(realpath -m "${OUT:-perf_out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PY:-python3}
PARTS=",${PARTS:-small,flash},"
PRESET=${PRESET:-small}; SEQ=${SEQ:-8192}; IMPLS=${IMPLS:-xla,best}
steps=(); [ -n "${STEPS:-}" ] && steps+=(--steps "$STEPS"); [ -n "${WARMUP:-}" ] && steps+=(--warmup "$WARMUP")
variants=(); [ -n "${VARIANTS:-}" ] && variants+=(--variants "$VARIANTS" --profile-variants)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true

run() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" >> "$OUT/log.txt" 2>&1 || echo "$name: exit $?" | tee -a "$OUT/log.txt"
}

if [[ $PARTS == *,small,* ]]; then
  run small 300 $PY -m benchmarks.bench_train --preset "$PRESET" --seq-len "$SEQ" --batch-size 1 \
    --impls "$IMPLS" "${steps[@]}" "${variants[@]}" --profile /tmp/prof_small \
    --out "$OUT/train_${PRESET}_T$SEQ.json"
  best=$(ls -t /tmp/prof_small 2>/dev/null | head -1)
  [ -n "$best" ] && run small-breakdown 120 $PY -m benchmarks.trace_breakdown "/tmp/prof_small/$best" \
    --top 25 --json "$OUT/breakdown_${PRESET}_$best.json"
fi
if [[ $PARTS == *,flash,* ]]; then
  run flash 300 $PY -m benchmarks.bench_train --preset v4-flash-layer --seq-len "$SEQ" \
    --batch-size 1 --impls best "${steps[@]}" --profile /tmp/prof_flash --out "$OUT/train_flash_T$SEQ.json"
  best=$(ls -t /tmp/prof_flash 2>/dev/null | head -1)
  [ -n "$best" ] && run flash-breakdown 120 $PY -m benchmarks.trace_breakdown "/tmp/prof_flash/$best" \
    --top 25 --json "$OUT/breakdown_flash_$best.json"
fi
if [[ $PARTS == *,probe,* ]]; then
  run probe $(( ${PROBE_S:-60} + 30 )) $PY -m benchmarks.train_ops_probe --preset "$PRESET" \
    --seq-len "$SEQ" --reps 10 --time-cap 0.3 --budget-s "${PROBE_S:-60}" --only "${PROBE_ONLY:-}" \
    --attn-impl "${PROBE_IMPL:-pallas_triton}" --attn-ratios "${PROBE_RATIOS:-4,128,0}" --attn-check xla \
    --attn-variants "${PROBE_VARIANTS:-}" --out "$OUT/probe.json"
fi
if [ -n "${1:-}" ]; then
  # (the before tree may predate benchmarks/ as a package: run the script by path there)
  (cd "$1" && PYTHONPATH=$PWD run base-small 240 $PY benchmarks/bench_train.py --preset small \
    --seq-len "$SEQ" --batch-size 1 --impls best --out "$OUT/train_small_T${SEQ}_base.json")
fi
grep -h -A4 "^| preset" "$OUT/log.txt"
grep -h -B1 -A16 "^| family" "$OUT/log.txt"
grep -h "^| " "$OUT/log.txt" | grep -v "^| preset\|^| family" | tail -40
