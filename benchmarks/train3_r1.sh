# expects commit COMMIT (branch train3, issue 17): small T=8192 B=1 step with the candidates on; isolated probes; <= 100 s wall (python under timeout 92 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT.
# One python process (one start-up):
#  1. bench_train small T=8192 B=1 pallas_triton, variant "fast" only (the default at this code is
#     small's 44.5 ms of acb8f3f = f74fe53: no change to it since): indexer_scores=kernel,
#     config.reduce_split=256, config.narrow_keys=true, config.qdo=true, config.dq_delta=true (and, at this commit, the
#     inverse map's unrolled offsets search on GPUs); 6 timed steps, then a 3-step profile;
#     trace_breakdown of it in a background process (CPU)
#  2. train_ops_probe (budget = what is left): indexer scores kernel vs XLA (time + max rel err +
#     same -inf), top-k ids with kernel scores vs XLA scores, attention backward (fwd + bwd) cr128:
#     default vs reduce_split 256; cr4: default vs int16 keys + qdo (+ dq_delta), vs those +
#     split 256; the
#     inverse map's unrolled vs loop search; cr128 split 128 (rel err vs default for each); at
#     small's H = 16 (the defaults were tuned at V4 widths): cr4 forward with 4 warps instead of
#     8, cr4 backward with 64-slot dq tiles instead of 32
set -u
OUT=${OUT:-/tmp/t3_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 T3_OUT="$OUT" T3_END_S=${END_S:-88}
export T3_PRESET=${PRESET:-small} T3_T=${SEQ:-8192} T3_STEPS=${STEPS:-6}
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout -k 3 ${LIMIT_S:-92} python3 - >> "$OUT/log.txt" 2>&1 <<'PY'
import glob, json, os, subprocess, sys, time
t0 = time.time()
out, T, preset = os.environ["T3_OUT"], int(os.environ["T3_T"]), os.environ["T3_PRESET"]
end = float(os.environ["T3_END_S"])
from benchmarks import bench_train, train_ops_probe

def log(msg):
    print(f"== {msg} at +{time.time() - t0:.0f} s", flush=True)

rows = []
def bench(variant, over, profile):
    log(f"bench {variant} {over}")
    try:
        r = bench_train.bench(preset, "pallas_triton", T, 1, int(os.environ["T3_STEPS"]), 1,
                              "bfloat16", profile=profile, model=dict(over), variant=variant)
    except Exception as e:
        log(f"bench {variant} failed: {type(e).__name__}: {str(e)[:400]}"); return
    r["mfu"], r["mfu_valid"] = r["model_tflops"] / 989.0, r["model_tflops_valid"] / 989.0
    rows.append(r)
    with open(f"{out}/bench.json", "w") as f:
        json.dump(dict(device="NVIDIA H200", commit=os.environ.get("T3_COMMIT", ""), rows=rows), f, indent=2)
    log(f"bench {variant}: {r['step_ms']:.2f} ms/step, {r['tokens_per_sec']:.0f} tok/s, "
        f"MFU {100 * r['mfu']:.2f}% (valid {100 * r['mfu_valid']:.2f}%), compile {r['compile_s']:.1f} s, loss {r['loss']:.4f}")

fast = {"indexer_scores": "kernel", "config.reduce_split": 256, "config.narrow_keys": True,
        "config.qdo": True, "config.dq_delta": True}
bench("fast", fast, "/tmp/t3p")
proc = None
dirs = glob.glob("/tmp/t3p/pallas_triton-fast")
if dirs:
    log("breakdown fast started (background)")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.trace_breakdown", dirs[0], "--top", "40",
                             "--json", f"{out}/breakdown_fast.json"],
                            stdout=open(f"{out}/breakdown_fast.txt", "w"), stderr=subprocess.STDOUT)
left = end - (time.time() - t0)
if left > 8:
    log(f"probe (budget {left - 6:.0f} s)")
    names = ("scores_full,scores_kernel,topk_prefix,topk_prefix_kernel,attn_cr128_default_bwd,"
             "attn_cr128_s256_bwd,attn_cr4_default_fwd,attn_cr4_w4_fwd,attn_cr4_default_bwd,"
             "attn_cr4_nq_bwd,attn_cr4_nqd_bwd,attn_cr4_dk64_bwd,inverse_map_s16,inverse_map_s16_scan,"
             "attn_cr4_s256nq_bwd,attn_cr128_s128_bwd")
    try:
        train_ops_probe.main(["--preset", preset, "--seq-len", str(T), "--reps", "10",
                              "--time-cap", "0.3", "--budget-s", f"{left - 6:.0f}", "--only", names,
                              "--attn-impl", "pallas_triton", "--attn-ratios", "128,4",
                              "--attn-variants", "s256:reduce_split=256; nq:narrow_keys=true,qdo=true; nqd:narrow_keys=true,qdo=true,dq_delta=true; s256nq:reduce_split=256,narrow_keys=true,qdo=true; s128:reduce_split=128; w4:num_warps=4; dk64:block_k_dq=64",
                              "--out", f"{out}/probe.json"])
    except Exception as e:
        log(f"probe failed: {type(e).__name__}: {str(e)[:400]}")
    log("probe done")
if proc is not None:
    try:
        proc.wait(timeout=max(2, end + 2 - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill(); log("the breakdown ran out of time")
log("all done")
PY
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
(cd /tmp/t3p 2>/dev/null && tar czf "$OUT/profile_fast.tgz" --exclude='*trace.json.gz' .) 2>/dev/null
[ -f "$OUT/profile_fast.tgz" ] && [ "$(stat -c %s "$OUT/profile_fast.tgz")" -gt 15000000 ] && rm -f "$OUT/profile_fast.tgz"
grep -h "^== \|^| \|vs scores_full\|vs topk" "$OUT/log.txt" | cut -c1-240
head -24 "$OUT/breakdown_fast.txt" 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
