# expects commit COMMIT (branch train3, issue 17): small T=8192 B=1 at the branch's defaults, the final figure; <= 65 s wall (python under timeout 60 s; 42 s was too short in the final call of session 3: nothing measured)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT (3 files).
#  bench_train small T=8192 B=1, best impl (pallas_triton; at this branch's defaults: the indexer
#  scores kernel, the dkv reduce split on the cr128 layers, 4 forward warps and 64-slot dq tiles
#  at H = 16), 1 warm-up (the compile, ~31 s in round 1) + 5 timed steps; no profile (~8 s more:
#  does not fit) and no probes (round 1's ran at +44..79 s; nothing left here)
set -u
OUT=${OUT:-/tmp/t3_out2}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout -k 2 ${LIMIT_S:-60} python3 -m benchmarks.bench_train --preset ${PRESET:-small} --seq-len ${SEQ:-8192} \
  --batch-size 1 --impls best --steps ${STEPS:-5} --warmup 1 --out "$OUT/bench.json" >> "$OUT/log.txt" 2>&1
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
grep -h "^| \|ms/step\|rc=" "$OUT/log.txt" | cut -c1-240
echo "total $(( $(date +%s) - t0 )) s"
