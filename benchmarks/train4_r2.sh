# expects commit COMMIT (branch train4, issue 17): per-layer attention backward at small's widths, the new default (interm=dq) vs the session-3 one and tuning variants; <= 60 s wall (python under timeout 55 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT.
# train_ops_probe --preset small --seq-len 8192 --attn-impl pallas_triton --attn-ratios 4,128
# --attn-check xla: forward + backward (jax.grad, both cotangents) of a cr4 / cr128 layer of
# `small` (H = 16, D = 128), median of 10 after a warm call, each checked against the default's
# outputs and against impl="xla"; the variants (on top of this branch's default, interm=dq):
#   gemm:   interm=gemm (the session-3 default: dS/P buffer + per-slot GEMM)
#   k32 / k16: 32- / 16-slot dq tiles (CPU compile report: 184 -> 126 / 95 registers, 0 spills)
#   k128w8: 128-slot dq tiles, 8 warps;  dqd: + dq_delta
#   dqs:    the dkv reduce split in 256-entry chunks;  r64 / rw8: reduce steps of 64 / 8 warps
set -u
OUT=${OUT:-/tmp/t4r2_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
names=attn_cr4_default_bwd,attn_cr4_gemm_bwd,attn_cr128_default_bwd,attn_cr128_gemm_bwd
names=$names,attn_cr4_k32_bwd,attn_cr4_k16_bwd,attn_cr4_dqs_bwd,attn_cr4_r64_bwd,attn_cr4_rw8_bwd
names=$names,attn_cr4_dqd_bwd,attn_cr4_k128w8_bwd,attn_cr128_k32_bwd,attn_cr128_k16_bwd
timeout -k 3 ${LIMIT_S:-55} python3 -m benchmarks.train_ops_probe --preset ${PRESET:-small} \
    --seq-len ${SEQ:-8192} --reps 10 --time-cap 0.3 --budget-s ${PROBE_S:-46} --no-ops \
    --only "$names" --attn-impl pallas_triton --attn-ratios 4,128 --attn-check xla \
    --attn-variants "default:; gemm:interm=gemm; k32:block_k_dq=32; k16:block_k_dq=16; k128w8:block_k_dq=128,num_warps_dq=8; dqd:dq_delta=true; dqs:reduce_split=256; r64:block_r=64; rw8:num_warps_reduce=8" \
    --out "$OUT/probe.json" > "$OUT/log.txt" 2>&1
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
grep -v "Deprecat\|warnings.warn" "$OUT/log.txt" | tail -20 | cut -c1-240
echo "total $(( $(date +%s) - t0 )) s"
