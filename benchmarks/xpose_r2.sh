# Superseded by benchmarks/xpose_sweep.sh (all 18 configs); kept as session 5's final call ran it (docs/perf/gluon_bwd_h200.md part 5c).
# xpose round 2 (final call, MERGED tree; needs branch xpose's bwd_dq_operand="strided" and bench_csa --check default with the
# on-device error, commit 70d6173). <= 60 s wall, one process under timeout -k 3 56.
# Round 1b's sweep lost its time to bench_csa's host-side float64 error check of T = 16384 outputs (2 of 15 Pro rows in 120 s);
# the check now runs on the device (_rel_err_device, same definition as problems.rel_err, f32). Issue 14's transposed-operand
# ablation, the default dq kernel, everything else equal: fwd / bwd / step of the 5 Config.bwd_dq_operand modes at Pro cr4
# (random) T = 16384 (round 1b has only default + strided), then Pro cr0 T = 16384 as far as the time goes; every variant
# checked against the default row in the same process (o, lse, dq, dkv, dsink). Rows are written as they finish.
# Estimate from round 1b's first_s: the default row ~9 s (fwd 2.6 + bwd 4.4 + step 1.0 s compiles + timing), each other
# mode ~5 s (its dq kernel compile 2.8 s + timing), start-up + inputs ~10 s: Pro cr4 ~40 s.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
PY=${PY:-python3}; SEQS=${SEQS:-16384}
timeout -k 3 56 $PY -m benchmarks.bench_csa --impls gluon --families pro --ratios 4,0 --seqs $SEQS --cr4-indices random \
  --modes fwd,bwd,step --reps 5 --time-cap 0.5 --check default \
  --variants 'lt:bwd_dq_operand=ldsm_trans;mm:bwd_dq_operand=movmatrix;da:bwd_dq_operand=desc_a;st:bwd_dq_operand=strided' \
  --out $OUT/xpose_pro_r2.json > $OUT/xpose_pro_r2.log 2>&1
echo "rc=$?"
grep -oE '"ratio": [0-9]+|"variant": "[a-z]+"|"(fwd|bwd|step)_ms": [0-9.]{1,6}|"dq": [0-9.e-]{1,8}|"error": "[^"]{0,80}' $OUT/xpose_pro_r2.log \
  | paste -sd' ' | sed 's/"ratio"/\n"ratio"/g'; echo
