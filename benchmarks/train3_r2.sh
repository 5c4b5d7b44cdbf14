# expects commit COMMIT (branch train3, issue 17): small T=8192 B=1 at the branch's defaults, final figure + a 3-step profile (breakdown read back on the dev machine); <= 60 s wall (python under timeout 54 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT (<= 4 files).
set -u
OUT=${OUT:-/tmp/t3_out2}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout -k 3 ${LIMIT_S:-54} python3 -m benchmarks.bench_train --preset ${PRESET:-small} --seq-len ${SEQ:-8192} \
  --batch-size 1 --impls best --steps ${STEPS:-6} --warmup 1 --profile /tmp/t3p2 --out "$OUT/bench.json" >> "$OUT/log.txt" 2>&1
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
(cd /tmp/t3p2 2>/dev/null && tar czf "$OUT/profile.tgz" --exclude='*trace.json.gz' .) 2>/dev/null
[ -f "$OUT/profile.tgz" ] && [ "$(stat -c %s "$OUT/profile.tgz")" -gt 15000000 ] && rm -f "$OUT/profile.tgz"
grep -h "^| \|ms/step" "$OUT/log.txt" | cut -c1-240
echo "total $(( $(date +%s) - t0 )) s"
