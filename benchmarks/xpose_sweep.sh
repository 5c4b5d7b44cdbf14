#!/usr/bin/env bash
# Issue 14's transposed-operand ablation at all 18 grid configs (H200): the 5 Config.bwd_dq_operand modes of the default dq kernel
# (desc = default, desc_a, ldsm_trans = transpose-load, movmatrix = (a) register transpose, strided = (b) strided shared reads),
# fwd / bwd / step each, every variant checked against the default row on the same inputs (o, lse, dq, dkv, dsink), then the
# per-config table and geomeans (benchmarks/xpose_table.py; exit 1 if a variant is not bit-equal to the default).
# The row settings of session 5's final call and session 6's calls A-C (docs/perf/gluon_bwd_h200.md, part 6, gives each command as run: their processes grouped the configs differently; this script as a whole has not been run):
# cr4 with 5 reps / 0.5 s (the forward's spread across modes, one kernel, <= 2% at Pro), cr0 / cr128 and Flash cr4 T <= 8192 with 30 / 1 s
# (5 reps left those rows' forward spread at up to 1.9x). ~14 min of GPU time in all (mostly compiles); PART=cr4 or PART=rest
# runs one half. Usage: OUT=dir bash benchmarks/xpose_sweep.sh
set -u
export PYTHONUNBUFFERED=1
O=${OUT:?set OUT to a results folder}; PY=${PY:-python3}; PART=${PART:-all}
V='lt:bwd_dq_operand=ldsm_trans;mm:bwd_dq_operand=movmatrix;da:bwd_dq_operand=desc_a;st:bwd_dq_operand=strided'
run() {  # name reps time-cap families ratios seqs timeout
  rm -f "$O/$1.json"          # a failed run leaves no older file of its name behind
  timeout -k 3 "$7" $PY -m benchmarks.bench_csa --impls gluon --families "$4" --ratios "$5" --seqs "$6" --cr4-indices random \
    --modes fwd,bwd,step --reps "$2" --time-cap "$3" --check default --variants "$V" --out "$O/$1.json" > "$O/$1.log" 2>&1
  echo "$1 rc=$?"
}
if [ "$PART" != rest ]; then
  run xpose_pro_cr4 5 0.5 pro 4 16384,8192,4096 300
  run xpose_flash_cr4_16384 5 0.5 flash 4 16384 120
fi
if [ "$PART" != cr4 ]; then
  run xpose_win_r30 30 1.0 pro,flash 0,128 16384,8192,4096 420
  run xpose_flash4_r30 30 1.0 flash 4 8192,4096 120
fi
files=()   # this script's groups only (other JSON in $O stays out); PART=cr4 + PART=rest into one $O make one table
for n in xpose_pro_cr4 xpose_flash_cr4_16384 xpose_win_r30 xpose_flash4_r30; do [ -f "$O/$n.json" ] && files+=("$O/$n.json"); done
$PY -m benchmarks.xpose_table "${files[@]}"
