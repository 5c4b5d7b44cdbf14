# expects commit COMMIT (branch train3, issue 17): small T=8192 B=1 at the branch's defaults (final figure), then probes in what is left; <= 45 s wall (python under timeout 41 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT (<= 4 files).
#  1. bench_train small T=8192 B=1 pallas_triton (the default: kernel indexer scores, reduce split
#     for cr128, 4 forward warps and 64-slot dq tiles at H = 16), 5 timed steps (no profile: its
#     ~8 s do not fit; the breakdown is round 1's)
#  2. train_ops_probe until +38 s: cr4 backward default vs qdo vs dq_delta; cr128 / cr0 forward
#     default (4 warps at H = 16) vs 8 warps (the old default)
set -u
OUT=${OUT:-/tmp/t3_out2}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 T3_OUT="$OUT" T3_END_S=${END_S:-38}
export T3_PRESET=${PRESET:-small} T3_T=${SEQ:-8192} T3_STEPS=${STEPS:-5}
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout -k 2 ${LIMIT_S:-41} python3 - >> "$OUT/log.txt" 2>&1 <<'PY'
import json, os, time
t0 = time.time()
out, T, preset = os.environ["T3_OUT"], int(os.environ["T3_T"]), os.environ["T3_PRESET"]
end = float(os.environ["T3_END_S"])
from benchmarks import bench_train, train_ops_probe

def log(msg):
    print(f"== {msg} at +{time.time() - t0:.0f} s", flush=True)

log("bench default")
try:
    r = bench_train.bench(preset, "pallas_triton", T, 1, int(os.environ["T3_STEPS"]), 1, "bfloat16",
                          profile=None)
    r["mfu"], r["mfu_valid"] = r["model_tflops"] / 989.0, r["model_tflops_valid"] / 989.0
    json.dump(dict(device="NVIDIA H200", rows=[r]), open(f"{out}/bench.json", "w"), indent=2)
    log(f"bench default: {r['step_ms']:.2f} ms/step, {r['tokens_per_sec']:.0f} tok/s, "
        f"MFU {100 * r['mfu']:.2f}% (valid {100 * r['mfu_valid']:.2f}%), compile {r['compile_s']:.1f} s, loss {r['loss']:.4f}")
except Exception as e:
    log(f"bench failed: {type(e).__name__}: {str(e)[:400]}")
left = end - (time.time() - t0)
if left > 3:
    log(f"probe (budget {left - 2:.0f} s)")
    try:
        train_ops_probe.main(["--preset", preset, "--seq-len", str(T), "--reps", "10", "--time-cap", "0.2",
                              "--budget-s", f"{left - 2:.0f}", "--no-ops", "--only",
                              "attn_cr4_default_bwd,attn_cr4_qdo_bwd,attn_cr4_dqd_bwd,attn_cr128_default_fwd,"
                              "attn_cr128_w8_fwd,attn_cr0_default_fwd,attn_cr0_w8_fwd",
                              "--attn-impl", "pallas_triton", "--attn-ratios", "4,128,0",
                              "--attn-variants", "qdo:qdo=true; dqd:dq_delta=true; w8:num_warps=8",
                              "--out", f"{out}/probe.json"])
    except Exception as e:
        log(f"probe failed: {type(e).__name__}: {str(e)[:400]}")
log("all done")
PY
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
grep -h "^== \|^| " "$OUT/log.txt" | cut -c1-240
echo "total $(( $(date +%s) - t0 )) s"
