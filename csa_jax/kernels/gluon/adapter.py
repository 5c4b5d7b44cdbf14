"""Compile Gluon kernels with Triton's own compiler and launch them from JAX.

jax-triton 0.3.1 runs ordinary `@triton.jit` kernels under `jax.jit`, but its compile path (JAX
-> TTIR -> its own TTGIR passes) rejects Gluon kernels ("Could not determine the number of warps
per CTA"): a Gluon kernel is already TTGIR, with layouts, and needs `ttg.num-warps` set before its
IR is built. This module keeps jax-triton's call primitive and lowering (`jax_triton.triton_call`,
the serialized `TritonKernelCall` handed to jaxlib's `triton_kernel_call` custom call) and replaces
only its kernel-building step for Gluon kernels:

1. `is_gluon(fn)` tells Gluon kernels apart; everything else keeps jax-triton's own path.
2. `build_signature` makes signature / attrs / constexprs as jax-triton does (pointer dtypes,
   divisibility 16 on every array pointer, metaparameters as constexpr).
3. `compile_kernel` runs `triton.compile(GluonASTSource(...), target=GPUTarget(...))` with a real
   cache directory (importing jax-triton sets TRITON_CACHE_DIR="", and Triton then fails with
   "Could not create or locate cache dir").
4. `launch_problem` refuses metadata that jaxlib's kernel call cannot honour (global or profile
   scratch, tensor memory, PDL, cooperative grids, clusters).
5. The patched builder hands jaxlib `TritonKernel(name, md.num_warps, ...)` with the TOTAL warp
   count, worker partitions included (the PTX has `.reqntid`; the user's num_warps fails at
   launch with CUDA_ERROR_INVALID_VALUE). On ROCm it compiles for the device's gfx arch
   (`hip_target`) and passes the code object's file path, as jax-triton does for its own ROCm
   kernels: UNTESTED, no ROCm device was available (the AMD kernels are compile-only here).

Launch facts (checked on the H200, ../shared/gpu_kernels.md): the PTX entry takes the user
pointers plus a global-scratch and a profile-scratch pointer, which jaxlib appends; jaxlib launches
`num_warps * 32` threads.

Everything up to step 4 runs on a CPU (the triton wheel bundles LLVM and ptxas), which is how CI
checks the kernels: `compile_kernel(..., target=GPUTarget("cuda", 90, 32))` and `resources()`.
jax-triton itself imports only on a CUDA/ROCm jaxlib, so it is imported lazily, in `gluon_call`.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import tempfile

import numpy as np

# Triton type names of array element dtypes (jax-triton's table, for the dtypes used here).
_TRITON_TYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}

TARGETS = {
    "sm_90a": ("cuda", 90, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "gfx1250": ("hip", "gfx1250", 32),
}

# Shared memory / LDS per block (bytes); nothing rejects an oversized kernel at compile time.
SHARED_LIMIT = {"sm_90a": 232_448, "gfx942": 65_536, "gfx950": 163_840, "gfx1250": 327_680}


_EXTRA = ("install the optional extra: pip install 'csa_jax[gluon]' "
          "(triton==3.6.0, jax-triton==0.3.1)")


def missing(launch: bool = False) -> str | None:
    """Why Gluon kernels cannot be compiled here (None if triton with Gluon is importable);
    launch=True also needs jax-triton installed (it is imported only when a kernel launches:
    on a CPU-only jaxlib its import fails)."""
    try:
        import triton  # noqa: F401
        from triton.experimental import gluon  # noqa: F401
    except ImportError as e:
        return f"triton with the Gluon dialect is not installed ({e}); {_EXTRA}"
    if launch and importlib.util.find_spec("jax_triton") is None:
        return f"jax-triton is not installed; {_EXTRA}"
    return None


def is_gluon(fn) -> bool:
    return bool(getattr(fn, "is_gluon", lambda: False)())


def triton_type(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _TRITON_TYPES:
        raise TypeError(f"dtype {name} has no Triton pointer type; supported: "
                        f"{sorted(_TRITON_TYPES)}")
    return "*" + _TRITON_TYPES[name]


def build_signature(fn, arg_types, constexprs):
    """(signature, attrs, constexprs) for GluonASTSource, the way jax-triton builds them.

    arg_types: one Triton type per runtime argument, in order ("*bf16" for an array); the kernel's
    remaining parameters must all be in `constexprs` (name -> value).
    """
    names = list(fn.arg_names)
    if len(arg_types) + len(constexprs) != len(names):
        raise TypeError(
            f"kernel {fn.__name__} has parameters {names}; got {len(arg_types)} runtime "
            f"arguments and constexprs {sorted(constexprs)}")
    unknown = sorted(set(constexprs) - set(names))
    if unknown:
        raise TypeError(f"constexprs {unknown} are not parameters of {fn.__name__} ({names})")
    runtime = [n for n in names if n not in constexprs]
    if runtime != names[:len(runtime)]:
        raise TypeError(f"kernel {fn.__name__}: runtime parameters must come before constexpr "
                        f"ones, got order {names} with constexprs {sorted(constexprs)}")
    signature = {}
    attrs = {}
    for i, (name, ty) in enumerate(zip(runtime, arg_types)):
        if not ty.startswith("*"):
            raise TypeError(f"argument {name!r} of {fn.__name__}: only array arguments are "
                            f"supported at run time (got type {ty!r}); pass scalars as constexprs")
        signature[name] = ty
        # jax-triton's assumption: XLA buffers are 16-byte aligned.
        attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(runtime):]:
        signature[name] = "constexpr"
    return signature, attrs, dict(constexprs)


def _ensure_cache_dir():
    import triton
    if not triton.knobs.cache.dir:
        path = os.path.join(tempfile.gettempdir(), f"csa_jax_triton_cache_{os.getuid()}")
        os.makedirs(path, exist_ok=True)
        triton.knobs.cache.dir = path


def make_target(target):
    """A triton GPUTarget from a name in TARGETS, another gfx name (hip_target), a (backend, arch,
    warp_size) tuple ("hip", "gfx942", 64) or itself."""
    from triton.backends.compiler import GPUTarget
    if isinstance(target, str):
        if target.startswith("gfx") and target not in TARGETS:
            return hip_target(target)
        if target not in TARGETS:
            raise ValueError(f"target={target!r} is unknown; choose one of {sorted(TARGETS)} "
                             f"or a gfx architecture name")
        target = TARGETS[target]
    if isinstance(target, tuple):
        target = GPUTarget(*target)
    return target


def hip_target(arch):
    """GPUTarget of a ROCm architecture name ("gfx942", "gfx942:sramecc+:xnack-"): wave64 on
    gfx9 (CDNA), wave32 on gfx10+ (RDNA, gfx1250)."""
    from triton.backends.compiler import GPUTarget
    arch = str(arch).split(":")[0]
    if not re.fullmatch(r"gfx[0-9a-f]+", arch):
        raise ValueError(f"arch={arch!r} is not a gfx architecture name")
    return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)


def _hsaco_file(asm):
    """jaxlib's ROCm TritonKernel takes the code object's path (as jax-triton passes it)."""
    fd, path = tempfile.mkstemp(suffix=".hsaco")
    with os.fdopen(fd, "wb") as f:
        f.write(asm["hsaco"])
    return path


@functools.lru_cache(maxsize=None)
def _compile_cached(fn, sig_items, attr_items, const_items, target, num_warps, options):
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource
    _ensure_cache_dir()
    src = GluonASTSource(fn, dict(sig_items), dict(const_items),
                         {k: [list(a) for a in v] for k, v in attr_items})
    return triton.compile(src, target=target, options={"num_warps": num_warps, **dict(options)})


def compile_kernel(fn, arg_types, constexprs, *, target="sm_90a", num_warps=4, options=None):
    """Compile a Gluon kernel for a target (works on a CPU); returns Triton's CompiledKernel."""
    if not is_gluon(fn):
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} is not a Gluon kernel "
                        f"(decorate it with triton.experimental.gluon.jit)")
    signature, attrs, consts = build_signature(fn, list(arg_types), constexprs)
    target = make_target(target)
    return _compile_cached(fn, tuple(signature.items()),
                           tuple((k, tuple(tuple(a) for a in v)) for k, v in attrs.items()),
                           tuple(sorted(consts.items())), target, int(num_warps),
                           tuple(sorted((options or {}).items())))


def launch_problem(md) -> str | None:
    """Why jaxlib's triton_kernel_call cannot launch a kernel with this metadata (None = it can)."""
    if getattr(md, "global_scratch_size", 0):
        return f"needs {md.global_scratch_size} B of global scratch (not wired through jaxlib here)"
    if getattr(md, "profile_scratch_size", 0):
        return f"needs {md.profile_scratch_size} B of profile scratch"
    if getattr(md, "tmem_size", 0):
        return f"uses {md.tmem_size} columns of tensor memory"
    if getattr(md, "launch_pdl", False):
        return "needs programmatic dependent launch"
    if getattr(md, "launch_cooperative_grid", False):
        return "needs a cooperative grid launch"
    if getattr(md, "num_ctas", 1) != 1:
        return f"num_ctas={md.num_ctas}: clusters are not launched through this adapter"
    return None


def ptxas_resources(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spills and static shared memory of a PTX module, from the bundled `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=False)
    text = r.stdout + r.stderr
    if r.returncode:
        raise RuntimeError(f"ptxas failed ({r.returncode}): {text[-2000:]}")
    return {"ptxas": text.strip(), **_grep_ints(text, _PTXAS_FIELDS)}


_PTXAS_FIELDS = (("registers", r"Used (\d+) registers"),
                 ("spill_stores", r"(\d+) bytes spill stores"),
                 ("spill_loads", r"(\d+) bytes spill loads"),
                 ("stack", r"(\d+) bytes stack frame"))
_AMDGCN_FIELDS = (("vgpr", r"\.vgpr_count:\s+(\d+)"), ("sgpr", r"\.sgpr_count:\s+(\d+)"),
                  ("vgpr_spill", r"\.vgpr_spill_count:\s+(\d+)"),
                  ("scratch", r"\.private_segment_fixed_size:\s+(\d+)"),
                  ("occupancy", r";\s*Occupancy:\s+(\d+)"))


def _grep_ints(text, fields):
    """{key: first integer captured by its pattern} for the patterns found in text."""
    out = {}
    for key, pat in fields:
        m = re.search(pat, text)
        if m:
            out[key] = int(m.group(1))
    return out


def resources(compiled, target="sm_90a") -> dict:
    """Compile-time resources of a CompiledKernel: shared memory, warps, registers, spills."""
    md = compiled.metadata
    return asm_resources(compiled.asm, target, name=md.name, num_warps=md.num_warps,
                         shared=md.shared, launch_problem=launch_problem(md))


def asm_resources(asm, target, **fields) -> dict:
    """Registers / VGPRs, spills, scratch, occupancy from a compile's assembly ({"ptx": ...} or
    {"amdgcn": ...}), with `fields` (name, num_warps, shared, ...) and the target's limit."""
    name = target if isinstance(target, str) else None
    out = {"target": name, **fields}
    if name in SHARED_LIMIT:
        out["shared_limit"] = SHARED_LIMIT[name]
    if "ptx" in asm:
        out.update(ptxas_resources(asm["ptx"]))
    elif "amdgcn" in asm:
        out.update(_grep_ints(asm["amdgcn"], _AMDGCN_FIELDS))
    return out


# ----------------------------------------------------------------------------- launch from JAX

_PATCHED = False


def _install():
    """Route Gluon kernels in jax-triton's lowering through compile_kernel (once per process)."""
    global _PATCHED
    try:
        import jax_triton
        from jax_triton import triton_lib
    except ImportError as e:
        raise ImportError(f"impl='gluon' needs jax-triton on a GPU jaxlib ({e}); {_EXTRA}") from e
    if _PATCHED:
        return jax_triton
    original = triton_lib.get_or_create_triton_kernel
    lib = triton_lib.triton_kernel_call_lib

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                      num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams,
                      dump):
        if not is_gluon(fn):
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args,
                            num_warps=num_warps, num_stages=num_stages, num_ctas=num_ctas,
                            compute_capability=compute_capability,
                            enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
        if platform not in ("cuda", "rocm"):
            raise NotImplementedError(f"Gluon launch from JAX: no {platform!r} path")
        if scalar_args:
            raise TypeError("Gluon kernels take arrays at run time; pass scalars as constexprs")
        cc = compute_capability or lib.get_compute_capability(0)
        if platform == "cuda":
            target = ("cuda", cc, 32)
        else:          # NEVER RUN (no ROCm device here): jax-triton's own ROCm path, mirrored
            target = hip_target(lib.get_arch_details(0))
        compiled = compile_kernel(fn, arg_dtypes, metaparams, target=target,
                                  num_warps=num_warps or 4)
        md = compiled.metadata
        why = launch_problem(md)
        if why:
            raise NotImplementedError(f"Gluon kernel {md.name}: {why}")
        binary = compiled.asm["ptx"] if platform == "cuda" else _hsaco_file(compiled.asm)
        kernel = lib.TritonKernel(md.name, md.num_warps, md.num_ctas, md.shared, binary,
                                  compiled.asm["ttgir"], cc)
        _, attrs, _ = build_signature(fn, arg_dtypes, metaparams)
        return kernel, attrs

    triton_lib.get_or_create_triton_kernel = get_or_create
    _PATCHED = True
    return jax_triton


def gluon_call(*arrays, kernel, out_shape, grid, num_warps, name="", **constexprs):
    """Call a Gluon kernel on JAX arrays (under jax.jit or eagerly); outputs follow the inputs
    in the kernel's parameter list, then the constexprs. Returns the output array(s)."""
    if not is_gluon(kernel):
        raise TypeError(f"{getattr(kernel, '__name__', kernel)!r} is not a Gluon kernel")
    jt = _install()
    return jt.triton_call(*arrays, kernel=kernel, out_shape=out_shape, grid=grid,
                          num_warps=num_warps, name=name or kernel.__name__, **constexprs)
