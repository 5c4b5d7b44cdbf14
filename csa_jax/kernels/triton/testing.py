"""Internal entry points of the Triton kernels, for benchmarks/ and tests/ only.

Not the public API (that is csa_jax.sparse_attention with impl="pallas_triton"): these names
expose a kernel's pieces so a benchmark can time them one by one, or a test can look inside.
They follow the kernels and may change with them; this module is the one place that lists them,
and nothing outside benchmarks/ and tests/ imports it.

    dims(q, kv, idx, config)            padded launch dims (_Dims: B, T, H, D, N, K, Hp, Dp, Kp)
    prep_idx(idx, dims)                 (idx padded to Kp with -1 [B, T, Kp], used slots [B, T])
    inverse_map(idx_p, N)               the dkv reduce's CSR: (offsets [B, N, 2], perm
                                        [B, T*Kp])
    reduce_rows(dims, config, interpret, offsets, perm, interm, dtype)  the gather-reduce
                                        kernel alone on a ready inverse map
    interm_gemm(dsp, q, do, precision, dtype)  the per-slot GEMM (with XLA's [q; dO] stack)
    forward_with_kernel(..., kernel=)   the forward launch with another kernel body (same
                                        signature as the library's; benchmarks/triton_fwd_probe.py)
    fwd_step, fwd_store                 the forward's tile step and output store (for such bodies)
    gather_tile, gather_rows            the kernels' gathers (for such bodies)
    backward_parts(..., parts=)         the backward with only some of ("dq", "interm", "reduce")
    dq_call(dims, config, scale, interpret, precision, used, idx_p, q, do, lse, delta, dlse, kv,
            dsp_dtype=None, interm_dtype=None)  the dq kernel's launch alone (and its dS/P
                                        buffer or, interm="dq", its per-slot intermediate)
"""
from csa_jax.kernels.triton.backward import _backward as backward_parts
from csa_jax.kernels.triton.backward import _dq_call as dq_call
from csa_jax.kernels.triton.backward import _interm_gemm as interm_gemm
from csa_jax.kernels.triton.backward import _inverse_map as inverse_map
from csa_jax.kernels.triton.backward import _reduce_rows as reduce_rows
from csa_jax.kernels.triton.forward import _forward as forward_with_kernel
from csa_jax.kernels.triton.forward import _fwd_step as fwd_step
from csa_jax.kernels.triton.forward import _fwd_store as fwd_store
from csa_jax.kernels.triton.plan import _dims as dims
from csa_jax.kernels.triton.plan import _gather_rows as gather_rows
from csa_jax.kernels.triton.plan import _gather_tile as gather_tile
from csa_jax.kernels.triton.plan import _prep_idx as prep_idx

__all__ = ["dims", "prep_idx", "inverse_map", "reduce_rows", "interm_gemm", "forward_with_kernel", "fwd_step", "fwd_store",
           "gather_tile", "gather_rows", "backward_parts", "dq_call"]
