#!/usr/bin/env bash
# Nsight Compute report of the pallas_triton forward and dq kernels (registers per thread,
# local-memory spill requests, occupancy and its limiters, pipe utilization, memory throughput).
#
#   PYTHONPATH=. bash benchmarks/triton_ncu.sh OUTDIR [bench_csa.py args...]
#
# Profiles the first launch of each kernel in a bench_csa.py run (default: Pro cr4 causal,
# T=4096, forward and backward, one timed rep, no check) and writes OUTDIR/ncu_fwd.txt and
# OUTDIR/ncu_dq.txt (KERNELS="dq" profiles only that one). Clocks are left alone (--clock-control none), as METHOD.md asks.
# Needs an NVIDIA GPU whose runtime lets ncu read the counters (Firecracker machines do).
set -euo pipefail
out=${1:?usage: triton_ncu.sh OUTDIR [bench_csa.py args...]}
shift
mkdir -p "$out"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "triton_ncu.sh: no ncu on PATH, /usr/local/cuda/bin or /opt/nvidia" >&2; exit 1; }
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--impls pallas_triton --families pro --ratios 4 --seqs 4096
                              --cr4-indices causal --modes fwd,bwd --reps 1 --check none)
here=$(cd "$(dirname "$0")" && pwd)
for k in ${KERNELS:-fwd dq}; do
  "$ncu" --clock-control none --kernel-name "regex:csa_triton_$k" --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 "$here/bench_csa.py" "${args[@]}" > "$out/ncu_$k.txt" 2>&1
  echo "== csa_triton_$k ($out/ncu_$k.txt)"
  grep -E "Duration|Registers Per Thread|Local Memory Spilling Requests |Block Limit (Registers|Shared Mem)|Achieved Occupancy|Compute \(SM\) Throughput|highest-utilized pipeline" "$out/ncu_$k.txt" || true
done
