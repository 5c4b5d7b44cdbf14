"""The impl registry: every implementation of the op is registered here once.

An impl is a module (or package) exposing the impl-module interface

    class Config                      frozen, validated dataclass of tuning knobs
    default_config(q_shape, kv_shape, idx_shape, dtype) -> Config
        (a module that uses a layout promise takes `layout=, window=, pool_ratio=` keywords
        too: sparse_attention(layout=...) passes them; csa_jax/layouts.py)
    forward(q, kv, idx, sink, *, scale, interpret, config) -> (o, lse)
    backward(q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config) -> (dq, dkv, dsink)
    unsupported(q_shape, kv_shape, idx_shape, dtype) -> str | None     (optional: why "auto"
                                                                        should skip it here)
    cannot_run_here() -> str | None    (optional: why no call can run on this machine's devices,
                                        e.g. a kernel with no interpreter and no GPU)

What the op guarantees to a module: validated shapes, q and kv of one dtype, idx int32 with every
value -1 or in [0, N), sink always an f32 [H] array (-inf = no sink), scale a Python float.
Kernels never import this file or csa_jax/vjp.py.

Registering an impl is one line below: `Impl(name, module, platforms=..., auto=...)`. `module`
is the module itself for an impl whose dependencies ship with csa_jax (a plain import, so the
op's imports lead to its kernels), or its dotted name plus `extra` / `requires` for an optional
backend, imported on first use; when it cannot be imported the impl reports "not available:
install csa_jax[<extra>]" instead of failing at import time.

What "auto" tries, in order (each candidate must list the platform in its `auto` and accept the
problem in its unsupported(), the capability check; "xla" when none does): on GPUs the row of
AUTO_GPU for the problem's head-count bucket and head dim (the measured-faster kernel first;
auto_order()), elsewhere the registration order.

An `Impl` is a frozen dataclass, hashable: the op passes the resolved impl itself as the static
argument of the custom_vjp, so the name is looked up once per call.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import types
from typing import Callable

from csa_jax import reference
from csa_jax.kernels import tpu, triton

FALLBACK = "xla"          # what "auto" runs when no kernel impl accepts the problem


class ImplUnavailable(NotImplementedError):
    """An impl that is registered but cannot run in this install (its optional extra is
    missing). A NotImplementedError, so callers that skip missing impls keep working."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """One registered implementation of sparse_attention.

    name       the `impl=` string.
    module     the impl module, or its dotted name when it is optional (imported lazily).
    platforms  jax backends where it runs compiled (elsewhere only in interpret mode).
    auto       platforms where impl="auto" may pick it (it still asks module.unsupported()).
    extra      optional impls: the pip extra that installs their dependencies.
    requires   optional impls: the exact pins of that extra ("triton==3.6.0"), checked before
               the import so a wrong version reports what is needed instead of failing deep in.
    here       optional: here(module) -> why it cannot run on this machine, or None; used when
               the module has no `cannot_run_here()` of its own.
    """
    name: str
    module: types.ModuleType | str
    platforms: tuple[str, ...]
    auto: tuple[str, ...] = ()
    extra: str | None = None
    requires: tuple[str, ...] = ()
    here: Callable[[types.ModuleType], str | None] | None = None

    # ---------------------------------------------------------------- loading

    @functools.cached_property
    def _loaded(self):
        """(module, None) or (None, reason it is not available); computed once."""
        if isinstance(self.module, types.ModuleType):
            return self.module, None
        for req in self.requires:
            dist, _, want = req.partition("==")
            try:
                have = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                return None, f"{dist} is not installed (needs {req})"
            if want and have != want:
                return None, f"found {dist} {have}, needs {req}"
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            own = e.name is not None and (self.module == e.name
                                          or self.module.startswith(e.name + "."))
            if not own and e.name not in {r.partition("==")[0].replace("-", "_")
                                          for r in self.requires}:
                raise                      # a bug inside the module, not a missing piece
            return None, f"no module {e.name}"
        missing = [f for f in ("Config", "default_config", "forward", "backward")
                   if not hasattr(mod, f)]
        if missing:
            return None, f"{self.module} lacks {', '.join(missing)}"
        return mod, None

    def unavailable(self) -> str | None:
        """None if the impl can run in this install, else why not and what to install."""
        mod, why = self._loaded
        if mod is not None:
            return None
        hint = f"install csa_jax[{self.extra}]" if self.extra else "it is not installed"
        return f"impl={self.name!r} is not available: {hint} ({why})"

    def cannot_run_here(self) -> str | None:
        """None if `sparse_attention(..., impl=<name>)` runs on this machine, else why not.

        "Runs here" means on jax's default backend, compiled where the impl's `platforms`
        include it and in interpret mode elsewhere (pallas_tpu and pallas_triton run
        interpreted on a CPU: correct, slow). An impl that has no interpreter and needs
        hardware this machine lacks (gluon: an NVIDIA Hopper GPU) does not run here. Asks the
        module's optional `cannot_run_here()` (or the registration's `here`) after the import
        check; that device check starts jax's backends (so call it after
        jax.distributed.initialize in a multi-process run)."""
        why = self.unavailable()
        if why is not None:
            return why
        check = getattr(self.mod, "cannot_run_here", None)
        if check is not None:
            why = check()
        elif self.here is not None:
            why = self.here(self.mod)
        return None if why is None else f"impl={self.name!r} cannot run here: {why}"

    @property
    def mod(self) -> types.ModuleType:
        """The impl module; ImplUnavailable if it cannot be imported here."""
        mod, _ = self._loaded
        if mod is None:
            raise ImplUnavailable(self.unavailable())
        return mod

    # ---------------------------------------------------------------- the interface

    @property
    def Config(self):
        return self.mod.Config

    def default_config(self, q_shape, kv_shape, idx_shape, dtype, layout=None):
        """The module's default Config; a layout promise (csa_jax.Layout) is passed to the
        modules whose default_config takes one (`layout`, `window`, `pool_ratio` keywords)."""
        if layout is not None and self.takes_layout:
            return self.mod.default_config(q_shape, kv_shape, idx_shape, dtype,
                                           layout=layout.kind, window=layout.window,
                                           pool_ratio=layout.pool_ratio)
        return self.mod.default_config(q_shape, kv_shape, idx_shape, dtype)

    @property
    def takes_layout(self) -> bool:
        """Whether the impl uses a layout promise (its default_config takes `layout`)."""
        return "layout" in inspect.signature(self.mod.default_config).parameters

    def unsupported(self, q_shape, kv_shape, idx_shape, dtype) -> str | None:
        """Why "auto" should not pick this impl for the problem here (None = it may)."""
        why = self.unavailable()
        if why is not None:
            return why
        check = getattr(self.mod, "unsupported", None)
        return None if check is None else check(q_shape, kv_shape, idx_shape, dtype)

    def forward(self, q, kv, idx, sink, *, scale, interpret, config):
        return self.mod.forward(q, kv, idx, sink, scale=scale, interpret=interpret,
                                config=config)

    def backward(self, q, kv, idx, sink, o, lse, do, dlse, *, scale, interpret, config):
        return self.mod.backward(q, kv, idx, sink, o, lse, do, dlse, scale=scale,
                                 interpret=interpret, config=config)


REGISTRY: dict[str, Impl] = {}

# Names that are part of the API but have no impl: requesting one says what to use instead.
RESERVED = {
    "pallas_mosaic_gpu": "reserved for Blackwell's TMA gather; on GPUs use impl='pallas_triton' "
                         "or impl='auto'",
}


def register(impl: Impl) -> Impl:
    if impl.name in REGISTRY or impl.name in RESERVED or impl.name == "auto":
        raise ValueError(f"impl name {impl.name!r} is already taken")
    REGISTRY[impl.name] = impl
    return impl


def _gluon_here(mod) -> str | None:
    """The gluon package's own device check (`_cannot_run`), asked about a problem its kernels
    take (bf16, 64 heads, D = 512): without an NVIDIA Hopper GPU (or a listed AMD one) nothing
    runs, as it has no interpreter. (Kept here until the package has a `cannot_run_here()`.)"""
    import jax.numpy as jnp

    return mod._cannot_run((1, 128, 64, 512), jnp.bfloat16)


# ------------------------------------------------------------------------------ the impls
register(Impl("xla", reference, platforms=("cpu", "gpu", "tpu")))
register(Impl("pallas_tpu", tpu, platforms=tpu.PLATFORMS, auto=("tpu",)))
# On GPUs "auto" tries gluon and pallas_triton in AUTO_GPU's order (below), each where its
# unsupported() allows it (gluon: NVIDIA compute capability 9.x, bf16/f16; pallas_triton: NVIDIA,
# bf16/f16).
register(Impl("gluon", "csa_jax.kernels.gluon", platforms=("gpu",), auto=("gpu",), extra="gluon",
              requires=("triton==3.6.0", "jax-triton==0.3.1"), here=_gluon_here))
register(Impl("pallas_triton", triton, platforms=triton.PLATFORMS, auto=("gpu",)))
# ------------------------------------------------------------------------------

# impl="auto" on GPUs: (head-count bucket, D) -> the impls to try, the measured-faster first
# (on every V4 layer type: until the few-heads dq kernel became gluon's default backward on
# 2026-12-07 the row of 16 split window lists, where pallas_triton was first, from pool lists
# by the slot count K). The bucket is the head count the
# kernels run at (heads_bucket: pallas_triton pads H to a power of two >= 16, above 64 to a
# multiple of 64; gluon to 16 / 32 up to 32 heads, above to a multiple of 64), so H = 12 uses
# the row of 16 and H = 96 that of 64. Measured on the H200 (bf16, B = 1, T = 16384, D = 512;
# wall clock per call, median of 5-7; step = forward + backward with both cotangents;
# docs/perf/heads_h200.md) and, where a row says so, on an H100 (device time per call;
# docs/perf/heads_h100.md). Until 2026-12-07 gluon's backward at H <= 32 was pallas_triton's,
# so the two differed by their forwards only (gluon's few-heads forward against pallas_triton's,
# same call, 2026-12-02 at c1a4b0e); since, gluon runs its few-heads dq kernel
# (small_heads_dq.py, 4649f34), which made its step faster at every H and layer type timed (H100,
# 2026-12-07, same calls, device time per call, T = 16384, step with pallas_triton's / the new
# backward: Pro cr4 H = 8 25.90 / 21.03, 16 25.57 / 22.45, 32 28.03 / 27.71; at H = 16 Pro
# cr0 4.32 / 4.05, cr128 6.99 / 6.39, Flash cr0 4.30 / 4.02, cr4 15.40 / 13.58, cr128 7.00 /
# 6.40).
AUTO_GPU = {
    # H = 8 (H100, 2026-12-07, same call, device time per call, T = 16384, fwd ms pallas_triton
    # / gluon at 585f009, whose few-heads forward no longer pads q / slices o in memory): Pro
    # cr0 0.83 / 0.49, cr4 3.66 / 3.25, cr128 1.10 / 0.77; Flash cr0 0.82 / 0.49, cr4 2.24 /
    # 1.87, cr128 1.09 / 0.76. Gluon on every layer type; the step differs by the forward only
    # (the same pallas_triton backward: Pro cr4 26.67 / 26.47 ms at 72977e5, before the change).
    (8, 512): ("gluon", "pallas_triton"),
    # H = 16: at c1a4b0e fwd ms pallas_triton / gluon: Pro cr0 0.83 / 1.02, Flash cr0 0.79 /
    # 0.99 (pallas_triton 1.23-1.25x faster on window lists). With the few-heads producer's
    # row ids two tiles ahead (9dd5cde; same call, device time per call, 9560e49): Pro cr4
    # 3.41 / 3.21, Flash cr4 1.97 / 1.88 (gluon 1.05-1.06x), Pro cr128 0.839 / 0.843, Flash
    # cr128 0.829 / 0.838 (level: 0.5-1%, inside the processes' spread); the step differs by
    # the forward only: gluon on pool lists. Window lists again on an H100 (2026-12-07, same
    # call): cr0 fwd 0.57 / 0.60 on Pro and Flash alike: pallas_triton's forward 5% faster,
    # but gluon's step with its own backward (4.02-4.05 ms) is 0.25-0.27 ms under its step
    # with pallas_triton's backward (4.30-4.32), which pallas_triton's whole step undercuts by
    # its forward's 0.03 ms only (an inference across two calls on H100s, not one call):
    # gluon on every layer type.
    (16, 512): ("gluon", "pallas_triton"),
    # H = 32: Pro cr4 5.70 / 5.00, Flash cr4 3.48 / 3.12, Pro cr128 1.64 / 1.48 (gluon
    # 1.11-1.14x), Pro cr4 step 26.13 / 25.20 (H200, c1a4b0e). Window lists on an H100
    # (2026-12-07, same call, device time per call): cr0 0.94 / 0.83 on Pro and Flash alike
    # (gluon 1.13x, since 9dd5cde's row ids two tiles ahead); H = 24 (this row): Pro cr0
    # 1.55 / 0.77, cr4 5.68 / 4.11, cr128 1.93 / 1.09. Gluon on every layer type.
    (32, 512): ("gluon", "pallas_triton"),
    # H >= 64: Pro cr4 step H = 64 39.93 / 28.14, H = 128 69.10 / 46.75: gluon.
    (64, 512): ("gluon", "pallas_triton"),
}
# A head dim without a row: pallas_triton only (gluon is measured at D = 512 only; pallas_triton
# at the `small` preset's D = 128 too, docs/perf/train_h200.md).
AUTO_GPU_OTHER_D = ("pallas_triton",)


def heads_bucket(H: int) -> int:
    """AUTO_GPU's head-count bucket of H heads: 8, 16, 32 (H up to it), or 64 (anything more)."""
    for b in (8, 16, 32):
        if H <= b:
            return b
    return 64


def auto_order(platform: str, q_shape) -> tuple[str, ...]:
    """The impl names "auto" tries on `platform` for q [B, T, H, D], in order (xla excluded: it
    is the fallback): AUTO_GPU's row on GPUs, the registration order elsewhere."""
    if platform == "gpu":
        H, D = q_shape[2], q_shape[3]
        return AUTO_GPU.get((heads_bucket(H), D), AUTO_GPU_OTHER_D)
    return tuple(n for n, impl in REGISTRY.items() if platform in impl.auto)


def names() -> tuple[str, ...]:
    """Every registered impl name (also those whose optional extra is missing)."""
    return tuple(REGISTRY)


def choices() -> tuple[str, ...]:
    """What a CLI offers for --impl: "auto" and every registered name."""
    return ("auto",) + names()


def available_impls() -> list[str]:
    """The registered impls that run on this machine: installed, and either compiled for its
    devices or interpreted (see Impl.cannot_run_here: pallas_tpu and pallas_triton run in
    interpret mode on a CPU; gluon needs an NVIDIA Hopper GPU). Starts jax's backends."""
    return [n for n, impl in REGISTRY.items() if impl.cannot_run_here() is None]


def get(name: str) -> Impl:
    """The registered impl of this name (it may still be unavailable: see Impl.mod)."""
    if isinstance(name, Impl):
        return name
    if name in REGISTRY:
        return REGISTRY[name]
    if name in RESERVED:
        raise NotImplementedError(f"impl={name!r} is not implemented ({RESERVED[name]})")
    raise ValueError(f"impl={name!r} is unknown; choose one of {choices()}")


def resolve(impl, q_shape, kv_shape, idx_shape, dtype, platform: str) -> Impl:
    """The Impl to run: the requested one (ValueError / NotImplementedError / ImplUnavailable if
    it cannot run: an explicit request never falls back), or for "auto" the first impl of
    auto_order(platform, q_shape) whose `auto` lists `platform` and whose
    unsupported() accepts the problem, else xla."""
    if impl != "auto":
        found = get(impl)
        found.mod                                  # ImplUnavailable if it cannot be imported
        return found
    for name in auto_order(platform, q_shape):
        cand = REGISTRY[name]
        if platform in cand.auto and cand.unsupported(q_shape, kv_shape, idx_shape,
                                                      dtype) is None:
            return cand
    return REGISTRY[FALLBACK]
