"""XLA flags for overlapped collectives, and a check of each flag against the installed jaxlib.

Many flags in older GPU recipes are unknown to jaxlib 0.11 and abort the process when they
appear in XLA_FLAGS (e.g. --xla_gpu_enable_async_all_gather: async collectives are now always
on). The ones used here, verified against jaxlib 0.11.2:

    --xla_gpu_enable_latency_hiding_scheduler=true   schedule async collectives around compute
    --xla_gpu_pipeline_all_gather=on                 collective pipelining of all-gathers ...
    --xla_gpu_pipeline_reduce_scatter=on             ... and reduce-scatters across loop iterations
    --xla_gpu_use_memcpy_local_p2p=true              local collective-permutes on copy engines
                                                     (the closest analog of the paper's SDMA)

Two ways to turn them on:
  * per compilation: `jax.jit(f, compiler_options=compiler_options(FSDP_GPU_FLAGS))`, which is
    what comm.fsdp's "xla" mode does (CPU ignores GPU options; an unknown one raises);
  * per process: `set_xla_flags(...)` before the first JAX computation (needed for
    --xla_gpu_use_memcpy_local_p2p, which the benchmark sets in a child process).

`check_flags(flags)` starts a child interpreter with the flags in XLA_FLAGS and reports the ones
the installed jaxlib rejects, without risking the calling process. NCCL_NVLS_ENABLE (NVLink
multicast) is never touched here.
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = [
    "FSDP_GPU_FLAGS",
    "MEMCPY_P2P_FLAG",
    "compiler_options",
    "check_flags",
    "set_xla_flags",
]

FSDP_GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_pipeline_all_gather=on",
    "--xla_gpu_pipeline_reduce_scatter=on",
)
MEMCPY_P2P_FLAG = "--xla_gpu_use_memcpy_local_p2p=true"

# XLA_FLAGS spells enums in lower case; compile options want the proto enum name.
_ENUM_VALUES = {
    "xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_",
    "xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_",
    "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_",
}


def _parse(flag: str) -> tuple[str, str]:
    if not flag.startswith("--") or "=" not in flag:
        raise ValueError(f"{flag=} must look like --name=value")
    name, value = flag[2:].split("=", 1)
    return name, value


def compiler_options(flags=FSDP_GPU_FLAGS) -> dict:
    """The flags as a `jax.jit(..., compiler_options=...)` dict."""
    out = {}
    for flag in flags:
        name, value = _parse(flag)
        if name in _ENUM_VALUES:
            out[name] = _ENUM_VALUES[name] + value.upper()
        elif value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
        else:
            out[name] = value
    return out


def set_xla_flags(flags, *, environ=os.environ) -> str:
    """Appends flags to XLA_FLAGS (skipping ones already there). Must run before JAX initializes
    its backends: XLA reads the variable once."""
    current = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    for flag in flags:
        _parse(flag)
        if flag.split("=", 1)[0] not in names:
            current.append(flag)
    environ["XLA_FLAGS"] = " ".join(current)
    return environ["XLA_FLAGS"]


def check_flags(flags, *, timeout: float = 120.0) -> dict[str, str | None]:
    """{flag: None if the installed jaxlib accepts it, else the error}, tried in a child process
    (an unknown flag in XLA_FLAGS aborts the process that reads it). One child for all flags;
    only if that fails, one child per flag to name the culprits."""

    def run(fs) -> str | None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(fs))
        code = "import jax, jax.numpy as jnp; jax.block_until_ready(jnp.ones(2) + 1)"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode == 0:
            return None
        lines = [ln for ln in proc.stderr.splitlines() if "flag" in ln.lower()] or proc.stderr.splitlines()
        return (lines[-1] if lines else f"exit code {proc.returncode}").strip()

    flags = list(flags)
    for flag in flags:
        _parse(flag)
    if run(flags) is None:
        return {f: None for f in flags}
    return {f: run([f]) for f in flags}
