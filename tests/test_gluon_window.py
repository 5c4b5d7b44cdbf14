"""impl="gluon" window reuse (Config.layout cr0 / cr128, kernels/gluon/window.py) on a CPU:
the layout promise's validation and the sm_90a compile. Numerics run on the GPU
(benchmarks/gluon_check.py --parts window, docs/perf/gluon_h200.md); the compile tests skip
without triton."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa_jax.indices import build_indices
from csa_jax.kernels import gluon as impl
from csa_jax.kernels.gluon import adapter


@pytest.mark.parametrize("kw, match", [
    (dict(layout="cr8"), "layout='cr8'"),
    (dict(layout="cr0", window=100), "window=100"),
    (dict(layout="cr128", window=256), "window=256"),
    (dict(window=0), "window=0"),
    (dict(pool_ratio=1), "pool_ratio=1"),
    (dict(pool_tile=24), "pool_tile=24"),
    (dict(pool_stages=0), "pool_stages=0"),
    (dict(win_programs=-1), "win_programs=-1"),
    (dict(win_producer_regs=44), "win_producer_regs=44"),
    (dict(win_p_smem=1), "win_p_smem=1"),
    (dict(win_ablate=4), "win_ablate=4"),
    (dict(layout="cr0", win_schedule="lockstep", win_ablate=3), "does not apply to 'lockstep'"),
    (dict(layout="cr0", win_schedule="overlap", win_ablate=1), "does not apply to 'overlap'"),
    (dict(win_prefetch=5), "win_prefetch=5"),
    (dict(layout="cr0", win_schedule="lockstep", win_prefetch=1), "exchange window kernels"),
    (dict(win_schedule="alternate"), "win_schedule='alternate' must be one of"),
    (dict(win_regs=220), "win_regs=220"),
    (dict(layout="cr0", win_schedule="exchange", win_p_smem=True), "lockstep window kernel"),
])
def test_config_rejects_bad_promise(kw, match):
    with pytest.raises(ValueError, match=match):
        impl.Config(**kw)


def test_cr4_and_generic_windows_are_free():
    """Only the window kernel restricts the window; cr4 / generic keep the gather kernel."""
    assert impl.Config(layout="cr4", window=100).window == 100
    assert impl.Config(window=7).layout == "generic"


def _idx(T, ratio, window=128, B=1):
    return np.broadcast_to(np.asarray(build_indices(T, ratio, window=window)),
                           (B, T, window + (T // ratio if ratio else 0)))


@pytest.mark.parametrize("layout, ratio", [("cr0", 0), ("cr128", 128)])
def test_check_layout_accepts_the_builders_lists_in_any_order(layout, ratio):
    T = 300
    idx = _idx(T, ratio, B=2)
    rng = np.random.default_rng(0)
    w, k = 128, idx.shape[-1]        # any order inside the window slots and inside the pool's
    perm = np.concatenate([rng.permutation(w), w + rng.permutation(k - w)])
    cfg = impl.Config(layout=layout)
    impl.check_layout(idx, T + T // 128, cfg)
    impl.check_layout(idx[..., perm], T + T // 128, cfg)
    if ratio:
        with pytest.raises(ValueError, match="breaks the promise"):     # not across the two
            impl.check_layout(idx[..., ::-1], T + T // 128, cfg)
    impl.check_layout(np.full((1, 4, 3), 5), 8, impl.Config())       # generic: nothing checked


@pytest.mark.parametrize("layout, ratio, edit, match", [
    ("cr0", 0, (0, 200, 5, 3), r"idx\[0, 200\] breaks the promise.*window rows 73..200"),
    ("cr0", 0, (1, 10, 127, -1), r"idx\[1, 10\].*window rows 0..10"),   # the token's own row
    ("cr128", 128, (0, 290, 128, -1), r"idx\[0, 290\].*pool rows 300..301"),
    ("cr128", 128, (0, 20, 129, 300), r"idx\[0, 20\].*no pool row"),
])
def test_check_layout_names_the_token(layout, ratio, edit, match):
    T = 300
    idx = np.array(_idx(T, ratio, B=2))
    b, t, j, v = edit
    idx[b, t, j] = v
    with pytest.raises(ValueError, match=match):
        impl.check_layout(idx, T + 2, impl.Config(layout=layout))


def test_check_layout_static_conditions():
    with pytest.raises(ValueError, match="K >= window, got K=64"):
        impl.check_layout(np.zeros((1, 4, 64), np.int32), 8, impl.Config(layout="cr0"))
    with pytest.raises(ValueError, match="num_kv=300 rows cannot hold the 2 pool rows"):
        impl.check_layout(_idx(300, 128), 300, impl.Config(layout="cr128"))


def test_sparse_attention_checks_the_promise_before_tracing():
    """api.py calls the impl's check_layout on a concrete idx: the error names the token, also
    on this CPU (before the impl says it cannot run here)."""
    import csa_jax
    T, D = 130, 64
    idx = np.array(_idx(T, 0))
    idx[0, 129, 3] = 7
    q = jnp.zeros((1, T, 64, D), jnp.bfloat16)
    kv = jnp.zeros((1, T, D), jnp.bfloat16)
    try:
        csa_jax.registry.get("gluon").mod
    except NotImplementedError as e:
        pytest.skip(str(e))
    with pytest.raises(ValueError, match=r"idx\[0, 129\] breaks the promise"):
        csa_jax.sparse_attention(q, kv, jnp.asarray(idx), impl="gluon",
                                 config=impl.Config(layout="cr0"))


# ----------------------------------------------------------------------------- compile only


def _compile(T=4096, NHB=2, D=512, window=128, G=66, ratio=0, producer_regs=40, p_smem=False,
             **kw):
    if adapter.missing():
        pytest.skip(adapter.missing())
    from csa_jax.kernels.gluon import window as win
    N = T + (T // ratio if ratio else 0)
    c = adapter.compile_kernel(
        win.csa_window_kernel, win.arg_types(),
        win.constexprs(T=T, N=N, NHB=NHB, D=D, window=window, G=G, ratio=ratio,
                       pool_tile=kw.get("pool_tile", 16), pool_stages=kw.get("pool_stages", 1),
                       scale=D ** -0.5, producer_regs=producer_regs, p_smem=p_smem),
        target="sm_90a", num_warps=win.CONSUMER_WARPS)
    return c, adapter.resources(c, "sm_90a")


def test_window_kernel_compiles_for_sm90a():
    """cr0 at the V4 shape: 12 warps, within shared memory (q 64 KiB + the 144-row span),
    the wgmma shapes of the span's products, contiguous 16-byte cp.async."""
    c, r = _compile()
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= r["shared_limit"]
    from csa_jax.kernels.gluon import window as win
    assert r["shared"] <= win.shared_bytes(512, 128, 0, 16, 1, 0)
    ptx = c.asm["ptx"]
    for n in (256, 32, 8):      # PV; the span's 64-row tiles and 16-row tail, per warpgroup
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    # a few loop-carried scalars spill (docs/perf/gluon_h200.md, window reuse): bounded here
    assert r["spill_stores"] <= 128, r


def test_window_kernel_cr0_p_smem_compiles():
    """cr0 with P through shared memory (one 128-row window product, m64n64 per warpgroup):
    within shared memory."""
    from csa_jax.kernels.gluon import window as win
    c, r = _compile(p_smem=True)
    assert r["shared"] <= win.shared_bytes(512, 128, 0, 16, 1, 1) <= r["shared_limit"]
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in c.asm["ptx"]
    assert r["spill_stores"] <= 128, r


@pytest.mark.parametrize("window, p_mode", [(64, 2), (128, 2)])
def test_window_kernel_cr128_compiles(window, p_mode):
    """cr128 at D = 512 fits only with the window's P in the pool slot (window.p_smem_mode)."""
    from csa_jax.kernels.gluon import window as win
    assert win.p_smem_mode(512, window, 128, 16, False) == p_mode
    _, r = _compile(T=700, NHB=1, window=window, G=44, ratio=128)
    assert r["shared"] <= r["shared_limit"], r
    assert r["shared"] <= win.shared_bytes(512, window, 128, 16, 1, p_mode), r
    assert r["spill_stores"] <= 320, r


def _compile_xchg(T=4096, NHB=2, window=128, G=66, regs=216):
    if adapter.missing():
        pytest.skip(adapter.missing())
    from csa_jax.kernels.gluon import window as win, window_xchg as wx
    c = adapter.compile_kernel(
        wx.csa_window_xchg_kernel, win.arg_types(),
        wx.constexprs(T=T, N=T, NHB=NHB, D=512, window=window, G=G, scale=512 ** -0.5,
                      consumer_regs=regs),
        target="sm_90a", num_warps=wx.NUM_WARPS)
    return c, adapter.resources(c, "sm_90a")


@pytest.mark.parametrize("T, NHB, window, G", [(4096, 2, 128, 66), (1000, 1, 64, 63)])
def test_window_exchange_kernel_compiles_without_spills(T, NHB, window, G):
    """cr0's exchange schedule: 12 warps (producer + two consumer warpgroups), within shared
    memory and its estimate, no spills; per warpgroup the scores of its span tiles (m64n64 /
    m64n32 and the 16-row tail m64n16) and PV on its 256 output columns (m64n256)."""
    from csa_jax.kernels.gluon import window_xchg as wx
    c, r = _compile_xchg(T, NHB, window, G)
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= wx.shared_bytes(512, window) <= r["shared_limit"], r
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    ptx = c.asm["ptx"]
    for n in (window // 2, 16, 256):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, n
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx


@pytest.mark.parametrize("layout, sched, want", [
    ("cr0", "auto", "exchange"), ("cr128", "auto", "gather"), ("generic", "exchange", "generic"),
    ("cr4", "auto", "generic"), ("cr0", "exchange", "exchange"), ("cr0", "overlap", "overlap"),
    ("cr128", "exchange", "lockstep"), ("cr128", "gather", "gather"), ("cr0", "gather", "gather"),
])
def test_window_schedule_resolution(layout, sched, want):
    assert impl.Config(layout=layout, win_schedule=sched).window_schedule() == want


def test_auto_window_64_runs_the_gather_kernel():
    """window 64 was not checked on the GPU: auto keeps the gather kernel there."""
    assert impl.Config(layout="cr0", window=64).window_schedule() == "gather"


def test_gather_schedule_ignores_the_promise(monkeypatch):
    """win_schedule="gather" under a cr0 promise runs the gather kernel on idx as given (no
    promise check: a broken list is still computed exactly)."""
    from csa_jax.kernels.gluon import fwd
    monkeypatch.setattr(impl, "_check", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    seen = []
    monkeypatch.setattr(fwd, "forward", lambda *a, **k: seen.append(k["config"]) or "gather")
    idx = np.full((1, 4, 128), -1, np.int32)          # breaks the cr0 promise everywhere
    cfg = impl.Config(layout="cr0", win_schedule="gather")
    assert impl.forward(None, jnp.zeros((1, 4, 8)), idx, None, scale=1.0, interpret=False,
                        config=cfg) == "gather"
    assert seen == [cfg]


def test_window_exchange_prefetch_compiles():
    """win_prefetch: the producer's L2 prefetch of a later token's q, 4 lines a thread, no
    spills; without it no prefetch."""
    if adapter.missing():
        pytest.skip(adapter.missing())
    from csa_jax.kernels.gluon import window as win, window_xchg as wx
    for ahead, n in ((0, 0), (2, 4)):
        c = adapter.compile_kernel(
            wx.csa_window_xchg_kernel, win.arg_types(),
            wx.constexprs(T=4096, N=4096, NHB=2, D=512, window=128, G=66, scale=0.05,
                          q_ahead=ahead), target="sm_90a", num_warps=wx.NUM_WARPS)
        assert c.asm["ptx"].count("prefetch.global.L2") == n
        r = adapter.resources(c, "sm_90a")
        assert r["spill_stores"] == 0, r


def test_window_schedule_selects_the_kernel(monkeypatch):
    """win_schedule="exchange" runs window_xchg's kernel for cr0 and the lockstep one for cr128
    (the launch is intercepted: no GPU here)."""
    from csa_jax.kernels.gluon import adapter as ad, window as win, window_xchg as wx
    seen = []

    def fake_call(*args, kernel, out_shape, grid, num_warps, name, **consts):
        seen.append((kernel, num_warps, grid, consts))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

    monkeypatch.setattr(ad, "gluon_call", fake_call)
    B, T, H, D = 1, 64, 128, 512
    for layout, ratio in (("cr0", 0), ("cr128", 128)):
        cfg = impl.Config(layout=layout, win_schedule="exchange")
        N = T + (T // ratio if ratio else 0) + 1
        q = jnp.zeros((B, T, H, D), jnp.bfloat16)
        kv = jnp.zeros((B, N, D), jnp.bfloat16)
        o, lse = win.forward(q, kv, jnp.zeros((H,)), jnp.zeros((B, T), bool), scale=0.1,
                             config=cfg)
        assert o.shape == (B, T, H, D) and lse.shape == (B, T, H)
    (k0, w0, g0, c0), (k1, w1, _, c1) = seen
    assert k0 is wx.csa_window_xchg_kernel and w0 == wx.NUM_WARPS and c0["CONSUMER_REGS"] == 216
    assert g0 == (1 * 2 * 4,)             # B x H/64 x G (G = the T / 16 = 4 blocks)
    assert k1 is win.csa_window_kernel and c1["RATIO"] == 128


def _violations_by_sets(idx, layout, w, ratio):
    """csa_spec.md section 4 by Python sets (the reference for layouts.violations)."""
    B, T, K = idx.shape
    bad = np.zeros((B, T), bool)
    for b, t in np.ndindex(B, T):
        win = [int(v) for v in idx[b, t, :w] if v >= 0]
        rest = [int(v) for v in idx[b, t, w:] if v >= 0]
        ok = sorted(win) == list(range(max(t - w + 1, 0), t + 1))
        if layout == "cr0":
            ok = ok and not rest
        elif layout == "cr128":
            ok = ok and sorted(rest) == [T + p for p in range((t + 1) // ratio)]
        bad[b, t] = not ok
    return bad


@pytest.mark.parametrize("layout, ratio, T, w", [("cr0", 0, 90, 16), ("cr4", 0, 60, 40),
                                                 ("cr128", 5, 120, 33)])
def test_traced_violations_match_the_set_definition(layout, ratio, T, w):
    """layouts.violations (bit-mask exact-set test, run under jit) against Python sets on
    random edits: rows dropped, duplicated, shifted, moved across the window / pool slots."""
    from csa_jax import layouts
    rng = np.random.default_rng(1)
    base = np.array(build_indices(T, ratio if layout == "cr128" else 0, window=w))[None]
    if layout == "cr4":
        base = np.concatenate([base, rng.integers(-1, T, (1, T, 5))], -1)
    f = jax.jit(lambda i: layouts.violations(i, layout, w, ratio or 128))
    seen = 0
    for trial in range(12):
        x = np.repeat(base, 2, 0)
        for _ in range(trial % 4):
            b, t, j = rng.integers(0, 2), rng.integers(0, T), rng.integers(0, x.shape[-1])
            x[b, t, j] = rng.choice([-1, int(rng.integers(0, T + T // 5)),
                                     int(x[b, t, (j + 1) % x.shape[-1]])])
        if trial % 3 == 0:
            k = x.shape[-1]
            x = x[..., np.concatenate([rng.permutation(w), w + rng.permutation(k - w)])]
        got = np.asarray(f(jnp.asarray(x, jnp.int32)))
        want = _violations_by_sets(x, layout, w, ratio or 128)
        if layout == "cr4":       # the pool slots are free: only the window counts
            want = _violations_by_sets(x[..., :w], "cr4", w, 128)
        np.testing.assert_array_equal(got, want)
        seen += int(want.sum())
    assert seen >= 4          # the edits did break tokens