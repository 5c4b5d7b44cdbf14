# expects commit COMMIT (branch train4, issue 17): the attention backward at small's widths (H = 16, D = 128), default vs interm=dq; <= 100 s wall (python under timeout 92 s)
# Runs from the tree root with PYTHONPATH=$PWD (+ jax-triton); everything goes to $OUT.
# One python process (one start-up):
#  1. train_ops_probe --preset small --seq-len 8192 --attn-impl pallas_triton --attn-ratios 4,128,0
#     --attn-check xla: per layer type (cr4 / cr128 / cr0 index lists of `small`), forward +
#     backward (jax.grad, both cotangents) at the default config and the variants below, each
#     checked against the default's outputs and against impl="xla" on the same inputs; median of
#     10 after a warm call; stops starting probes after --budget-s
#       dq:   interm=dq (the dq kernel writes the per-slot intermediate itself: no dS/P buffer,
#             no per-slot GEMM, no [q; dO] copy)
#       dqd:  dq + dq_delta (delta = rowsum(o dO) formed in the dq kernel)
#       dq32: dq with 32-slot dq tiles (184 -> 128 registers on the CPU compile report)
#       dqw8: dq with 8 dq warps;  r64 / rw8: the dkv reduce with 64-entry steps / 8 warps
#       dqs:  dq with the dkv reduce split in 256-entry chunks (cr4's popular pool rows)
#  2. bench_train small T=8192 B=1 pallas_triton, variant "dq" (config.interm=dq) only (the
#     default's step is call A's 37.9 ms at 397a79a, the same code but this option): 5 timed
#     steps, then a 3-step profile; trace_breakdown of it in a background process (CPU)
set -u
OUT=${OUT:-/tmp/t4_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 T4_OUT="$OUT" T4_END_S=${END_S:-88}
export T4_PRESET=${PRESET:-small} T4_T=${SEQ:-8192} T4_STEPS=${STEPS:-5} T4_PROBE_S=${PROBE_S:-30}
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout -k 3 ${LIMIT_S:-92} python3 - >> "$OUT/log.txt" 2>&1 <<'PY'
import glob, json, os, subprocess, sys, time
t0 = time.time()
out, T, preset = os.environ["T4_OUT"], int(os.environ["T4_T"]), os.environ["T4_PRESET"]
end = float(os.environ["T4_END_S"])
from benchmarks import bench_train, train_ops_probe

def log(msg):
    print(f"== {msg} at +{time.time() - t0:.0f} s", flush=True)

log("probe")
names = ",".join(f"attn_cr{r}_{v}_bwd" for r, v in (
    (4, "default"), (4, "dq"), (128, "default"), (128, "dq"), (0, "default"), (0, "dq"),
    (4, "dqd"), (4, "dqs"), (4, "dq32"), (4, "dqw8"), (4, "r64"), (4, "rw8"), (128, "dqd"),
    (0, "dqd")))
try:
    train_ops_probe.main(["--preset", preset, "--seq-len", str(T), "--reps", "10",
                          "--time-cap", "0.3", "--budget-s", os.environ["T4_PROBE_S"],
                          "--no-ops", "--only", names, "--attn-impl", "pallas_triton",
                          "--attn-ratios", "4,128,0", "--attn-check", "xla",
                          "--attn-variants", "default:; dq:interm=dq; dqd:interm=dq,dq_delta=true; dq32:interm=dq,block_k_dq=32; dqw8:interm=dq,num_warps_dq=8; dqs:interm=dq,reduce_split=256; r64:block_r=64; rw8:num_warps_reduce=8",
                          "--out", f"{out}/probe.json"])
except Exception as e:
    log(f"probe failed: {type(e).__name__}: {str(e)[:400]}")
log("probe done")

rows = []
def bench(variant, over, profile):
    log(f"bench {variant} {over}")
    try:
        r = bench_train.bench(preset, "pallas_triton", T, 1, int(os.environ["T4_STEPS"]), 1,
                              "bfloat16", profile=profile, model=dict(over), variant=variant)
    except Exception as e:
        log(f"bench {variant} failed: {type(e).__name__}: {str(e)[:400]}"); return
    r["mfu"], r["mfu_valid"] = r["model_tflops"] / 989.0, r["model_tflops_valid"] / 989.0
    rows.append(r)
    with open(f"{out}/bench.json", "w") as f:
        json.dump(dict(device="NVIDIA H200", rows=rows), f, indent=2)
    log(f"bench {variant}: {r['step_ms']:.2f} ms/step, {r['tokens_per_sec']:.0f} tok/s, "
        f"MFU {100 * r['mfu']:.2f}% (valid {100 * r['mfu_valid']:.2f}%), compile {r['compile_s']:.1f} s, loss {r['loss']:.4f}")

bench("dq", {"config.interm": "dq"}, "/tmp/t4p")
proc = None
dirs = glob.glob("/tmp/t4p/pallas_triton-dq")
if dirs:
    log("breakdown dq started (background)")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.trace_breakdown", dirs[0], "--top", "40",
                             "--json", f"{out}/breakdown_dq.json"],
                            stdout=open(f"{out}/breakdown_dq.txt", "w"), stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=max(2, end + 2 - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill(); log("the breakdown ran out of time")
log("all done")
PY
echo "python rc=$? at +$(( $(date +%s) - t0 )) s" >> "$OUT/log.txt"
grep -h "^== \|^| " "$OUT/log.txt" | cut -c1-240
head -24 "$OUT/breakdown_dq.txt" 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
