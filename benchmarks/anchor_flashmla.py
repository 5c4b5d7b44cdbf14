"""FlashMLA's SM90 sparse prefill forward as a same-call anchor: `bench_csa --anchor DIR`.

DIR holds the harness of ../shared/anchors/flashmla (build.py and its binding, which build only
FlashMLA's d_qk = 512 sparse prefill into a torch extension on the GPU machine, ~35 s) and the
public sources it compiles (flashmla/csrc at deepseek-ai/FlashMLA 9241ae3, cutlass/include and
cutlass/tools/util/include at the commit FlashMLA pins): fetched, kept in a git-ignored folder
and carried to the GPU machine; never committed (FlashMLA is a comparison, not our code).

On the same inputs as the JAX impls (B = 1, D = 512, bf16): q [T, H, D] with the heads padded
to a multiple of 64 by zero heads (FlashMLA's CTA is 64 heads: how inference engines run it at
H < 64), kv [N, 1, D], idx [T, 1, K] padded with -1 to a multiple of 128 (FlashMLA computes
invalid slots like valid ones, so padding and -1 slots cost it time), sink [H]. Its lse excludes
the sink: logaddexp(lse, sink) is ours. The arrays cross between JAX and torch by DLPack (no
copy), each side synchronised first.
"""
from __future__ import annotations

import importlib
import os
import sys


class Unavailable(RuntimeError):
    """The anchor cannot run here (no torch, no sources, not an SM90 GPU, a shape it lacks)."""


def load(path):
    """The built extension module (FlashMLA's sparse_prefill_fwd) from the harness in `path`."""
    path = os.path.abspath(path)
    for need in ("build.py", "sm90_sparse_fwd_binding.cpp", "flashmla/csrc", "cutlass/include"):
        if not os.path.exists(os.path.join(path, need)):
            raise Unavailable(f"--anchor {path}: {need} is missing (benchmarks/anchor_flashmla.py "
                              f"says what the folder holds)")
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"the FlashMLA anchor needs torch ({e})") from e
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise Unavailable("the FlashMLA anchor needs an SM90 GPU")
    os.environ.setdefault("FMLA_SRC", path)
    sys.path.insert(0, path)
    try:
        build = importlib.import_module("build")
    finally:
        sys.path.remove(path)
    return build.load(verbose=False)


def synced(out):
    """out after waiting for the device (torch's stream): bench_csa's pipelined timing."""
    import torch
    torch.cuda.synchronize()
    return out


def prepare(mod, q, kv, idx, sink, scale):
    """A callable running FlashMLA's forward on the JAX arrays q [1, T, H, D], kv [1, N, D],
    idx [1, T, K] (-1 = empty), sink [H] or None: returns torch (o [T, Hp, D], lse_nosink
    [T, Hp]) after a device synchronisation (run(sync=False): without it); and `to_jax(out)`
    -> (o [1, T, H, D], lse [1, T, H] with the sink joined) as JAX arrays."""
    import jax
    import jax.numpy as jnp
    import torch
    B, T, H, D = q.shape
    N, K = kv.shape[1], idx.shape[2]
    if B != 1 or D != 512 or q.dtype != jnp.bfloat16:
        raise Unavailable(f"FlashMLA's build takes B = 1, D = 512, bf16 (got B={B}, D={D}, "
                          f"{q.dtype})")
    jax.block_until_ready((q, kv, idx, sink))
    Hp, Kp = -(-H // 64) * 64, -(-K // 128) * 128
    tq = torch.from_dlpack(q)[0]                                    # [T, H, D]
    if Hp != H:
        tq = torch.cat([tq, tq.new_zeros(T, Hp - H, D)], dim=1)
    tkv = torch.from_dlpack(kv)[0][:, None, :]                      # [N, 1, D]
    ti = torch.from_dlpack(idx)[0].to(torch.int32)
    ti = torch.where((ti >= 0) & (ti < N), ti, torch.full_like(ti, -1))
    if Kp != K:
        ti = torch.cat([ti, ti.new_full((T, Kp - K), -1)], dim=1)
    ti = ti[:, None, :].contiguous()                                # [T, 1, Kp]
    tsink = (torch.from_dlpack(sink).float() if sink is not None
             else torch.full((H,), float("-inf"), device=tq.device))
    if Hp != H:
        tsink = torch.cat([tsink, tsink.new_zeros(Hp - H)])
    tq, tkv, tsink = tq.contiguous(), tkv.contiguous(), tsink.contiguous()
    torch.cuda.synchronize()

    def run(sync=True):
        out, _, lse = mod.sparse_prefill_fwd(tq, tkv, ti, float(scale), tsink)
        if sync:
            torch.cuda.synchronize()
        return out, lse

    def to_jax(res):
        out, lse = res
        lse = torch.logaddexp(lse, tsink[None, :])
        o = jnp.from_dlpack(out[:, :H].contiguous())[None]
        return o, jnp.from_dlpack(lse[:, :H].contiguous())[None]

    return run, to_jax
