# xpose round 1b: expects commit a2f26c5 (branch xpose) or later (later commits: docs only). <= 197 s wall, 3 parts in sequence.
# Issue 14's transposed-operand ablation per config: the default dq kernel's Config.bwd_dq_operand, everything else equal:
#   default = "desc" (kv as the MN-major, "transposed", B descriptor), da = desc_a (kv^T as an MN-major A descriptor),
#   lt = ldsm_trans (kv^T into registers by ldmatrix .trans, the transpose-load), mm = movmatrix (plain ldmatrix + an
#   explicit register transpose), st = strided (NEW on this branch: plain 2-byte shared loads in transposed order, no ldmatrix).
# 1 (<=120 s) bench_csa fwd/bwd/step, Pro cr4(random)/cr0/cr128 T=16384, 5 modes, each variant checked against the default
#   row on the same inputs (--check default, new on this branch: rel_err_vs_default of o, lse, dq, dkv, dsink); a row is
#   written to the JSON as soon as it finishes, so a timeout keeps the finished rows.
# 2 (<=45 s) the same for Flash (as many configs as fit).
# 3 (<=30 s) gluon_bwd_check grad: strided vs xla, 2 cases (dq, dkv, dsink, both cotangents).
# CPU estimate: one dq-kernel variant compiles in ~2 s here (5 modes x 2 families: 2-3 s each); GPU rounds so far ~7-8 s
# per (config, variant) for bwd+dq (close14 r1). A CPU dry run (PY=<venv python> SEQS=1024) parsed every variant/case.
set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
PY=${PY:-python3}; SEQS=${SEQS:-16384}
V='st:bwd_dq_operand=strided;lt:bwd_dq_operand=ldsm_trans;mm:bwd_dq_operand=movmatrix;da:bwd_dq_operand=desc_a'
sweep() {  # name family limit
  timeout -k 3 $3 $PY -m benchmarks.bench_csa --impls gluon --families $2 --ratios 4,0,128 --seqs $SEQS \
    --cr4-indices random --modes fwd,bwd,step --reps 5 --time-cap 0.5 --check default --variants "$V" \
    --out $OUT/$1.json > $OUT/$1.log 2>&1
  echo "rc=$?"
  grep -oE '"ratio": [0-9]+|"variant": "[a-z]+"|"(fwd|bwd|step)_ms": [0-9.]{1,6}|"dq": [0-9.e-]{1,8}|"error": "[^"]{0,80}' $OUT/$1.log \
    | paste -sd' ' | sed 's/"ratio"/\n"ratio"/g'; echo
}
el pro; sweep xpose_pro pro 120
el flash; sweep xpose_flash flash 45
el grad
timeout -k 3 30 $PY -m benchmarks.gluon_bwd_check --parts grad --seed 55150 --grad-variants 'st:bwd_dq_operand=strided' \
  --skip default,e2e --grad-cases h128_d512_bf16_k1152,h16_d64_bf16_sink_pad --out $OUT/xpose_grad.json > $OUT/xpose_grad.log 2>&1
echo "rc=$?"; grep -E '"part": "grad"|Error|error' $OUT/xpose_grad.log | cut -c1-300
el done
