# expects commit COMMIT (branch train4, issue 17): per-layer attention backward of small at the final defaults (interm=dq, block_r=64) vs block_r=32, cr128 / cr0 / cr4, checked vs xla; <= 40 s wall (python under timeout 36 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT.
# train_ops_probe --preset small --seq-len 8192 --attn-impl pallas_triton --attn-ratios 128,0,4
# --attn-check xla: forward + backward (jax.grad, both cotangents) of one layer at small's
# shapes, median of 10 after a warm call, checked against the default's outputs and impl="xla";
# variants on top of the default: r32 (block_r=32, round 2's default), r128 (block_r=128)
set -u
OUT=${OUT:-/tmp/t4r3_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
names=attn_cr128_default_bwd,attn_cr128_r32_bwd,attn_cr0_default_bwd,attn_cr0_r32_bwd
names=$names,attn_cr4_default_bwd,attn_cr4_r128_bwd,attn_cr4_r32_bwd
timeout -k 3 ${LIMIT_S:-36} python3 -m benchmarks.train_ops_probe --preset ${PRESET:-small} \
    --seq-len ${SEQ:-8192} --reps 10 --time-cap 0.3 --budget-s ${PROBE_S:-27} --no-ops \
    --only "$names" --attn-impl pallas_triton --attn-ratios 128,0,4 --attn-check xla \
    --attn-variants "default:; r32:block_r=32; r128:block_r=128" \
    --out "$OUT/probe.json" > "$OUT/log.txt" 2>&1
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
grep -v "Deprecat\|warnings.warn" "$OUT/log.txt" | tail -12 | cut -c1-240
echo "total $(( $(date +%s) - t0 )) s"
