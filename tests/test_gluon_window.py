"""impl="gluon" window reuse under the cr0 promise (kernels/gluon/window.py) on a CPU: the layout
promise (csa_jax.Layout, `sparse_attention(layout=)`, Config.layout), its checks, which kernel it
selects, and the sm_90a compile. Numerics run on the GPU (benchmarks/gluon_check.py,
docs/perf/heads_h200.md); the compile tests skip without triton."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_jax
from csa_jax.indices import build_indices
from csa_jax.kernels import gluon as impl
from csa_jax.kernels.gluon import adapter


def test_layout_type_rejects_bad_values():
    for kw, match in ((dict(kind="cr8"), "kind='cr8'"), (dict(kind="cr0", window=0), "window=0"),
                      (dict(kind="cr128", pool_ratio=1), "pool_ratio=1")):
        with pytest.raises(ValueError, match=match):
            csa_jax.Layout(**kw)
    with pytest.raises(TypeError, match="layout must be None"):
        csa_jax.sparse_attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 8)),
                                 jnp.zeros((1, 4, 2), jnp.int32), impl="xla", layout=0)


def test_only_cr0_with_window_128_runs_the_window_kernel():
    """The measured case (docs/perf/heads_h200.md: cr0 window 128 faster than the gather
    kernel); window 64 was never checked on the GPU and cr128's window kernel was slower: both
    run the gather kernel."""
    assert impl.Config(layout="cr0").window_kernel
    assert not impl.Config(layout="cr0", window=64).window_kernel
    assert not impl.Config(layout="cr128").window_kernel
    assert not impl.Config(layout="cr4").window_kernel and not impl.Config().window_kernel
    # ... and only above 32 heads (below, the few-heads forward: heads_h100.md)
    assert impl.Config(layout="cr0").runs_window_kernel(33)
    assert not impl.Config(layout="cr0").runs_window_kernel(32)
    assert not impl.Config(layout="cr0", window=64).runs_window_kernel(128)


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
    on this CPU (before the impl says it cannot run here), for the keyword and the Config."""
    T, D = 130, 64
    idx = np.array(_idx(T, 0))
    idx[0, 129, 3] = 7
    q = jnp.zeros((1, T, 64, D), jnp.bfloat16)
    kv = jnp.zeros((1, T, D), jnp.bfloat16)
    try:
        csa_jax.registry.get("gluon").mod
    except NotImplementedError as e:
        pytest.skip(str(e))
    for kw in (dict(layout="cr0"), dict(config=impl.Config(layout="cr0"))):
        with pytest.raises(ValueError, match=r"idx\[0, 129\] breaks the promise"):
            csa_jax.sparse_attention(q, kv, jnp.asarray(idx), impl="gluon", **kw)
    with pytest.raises(ValueError, match="disagrees with config"):
        csa_jax.sparse_attention(q, kv, jnp.asarray(idx), impl="gluon", layout="cr128",
                                 config=impl.Config(layout="cr0"))


def test_layout_keyword_reaches_the_impls_that_use_it():
    """registry: the promise goes to default_config where it takes one (gluon, pallas_tpu), the
    others ignore it; the NNX layer promises its layer type."""
    from csa_jax import registry
    from csa_jax.config import CSAConfig
    from csa_jax.layers import CSAAttention
    lay = csa_jax.Layout("cr128", window=64, pool_ratio=16)
    shape = ((1, 64, 64, 512), (1, 68, 512), (1, 64, 68), jnp.bfloat16)
    for name in ("gluon", "pallas_tpu"):
        try:
            c = registry.get(name).default_config(*shape, lay)
        except NotImplementedError as e:         # gluon without its extra
            pytest.skip(str(e))
        assert (c.layout, c.window, c.pool_ratio) == ("cr128", 64, 16), name
    assert not registry.get("xla").takes_layout and not registry.get("pallas_triton").takes_layout
    assert registry.get("xla").default_config(*shape, lay) == registry.get("xla").Config()
    want = {0: csa_jax.Layout("cr0", 128), 4: csa_jax.Layout("cr4", 128),
            16: csa_jax.Layout("cr128", 128, 16)}
    for ratio, lay in want.items():
        import flax.nnx as nnx
        layer = CSAAttention(CSAConfig(ratio=ratio, num_heads=2, head_dim=64, d_model=32,
                                       q_rank=16, o_groups=1, o_rank=8, rope_dim=16,
                                       index_heads=2, index_dim=16, topk=4 if ratio == 4 else 0),
                             rngs=nnx.Rngs(0))
        assert layer.layout == lay, ratio


def test_window_kernel_is_selected_and_poisons_broken_tokens(monkeypatch):
    """Under the cr0 promise the forward launches window.csa_window_kernel (the launch is
    intercepted: no GPU here) with the traced promise check's verdict as its `bad` input;
    without it, or at window 64, the gather kernel."""
    from csa_jax.kernels.gluon import fwd, window as win
    seen = []

    def fake_call(*args, kernel, out_shape, grid, num_warps, name, **consts):
        seen.append((kernel, num_warps, grid, consts))
        o, lse = (jnp.zeros(s.shape, s.dtype) for s in out_shape)
        if kernel is win.csa_window_kernel:   # hand the kernel's `bad` input back through lse
            lse = jnp.repeat(args[3].astype(lse.dtype), lse.shape[0] // args[3].shape[0])
        return o, lse

    monkeypatch.setattr(adapter, "gluon_call", fake_call)
    monkeypatch.setattr(impl, "_check", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    B, T, H, D = 1, 64, 128, 512
    q = jnp.zeros((B, T, H, D), jnp.bfloat16)
    kv = jnp.zeros((B, T, D), jnp.bfloat16)
    idx = np.array(_idx(T, 0))
    idx[0, 5, 0] = 40                             # token 5 breaks the promise
    lses = []
    for cfg in (impl.Config(layout="cr0"), impl.Config(layout="cr0", window=64), impl.Config()):
        o, lse = jax.jit(lambda i, c=cfg: impl.forward(q, kv, i, jnp.zeros((H,)), scale=0.1,
                                                       interpret=False, config=c))(idx)
        assert o.shape == (B, T, H, D) and lse.shape == (B, T, H)
        lses.append(np.asarray(lse))
    (k0, w0, g0, c0), (k1, *_), (k2, *_) = seen
    assert k0 is win.csa_window_kernel and w0 == win.NUM_WARPS and c0["CONSUMER_REGS"] == 216
    assert g0 == (1 * 2 * 4,)             # B x H/64 x G (G = the T / 16 = 4 blocks)
    assert np.flatnonzero(lses[0][0, :, 0]).tolist() == [5]        # bad: token 5 only
    assert k1 is fwd.csa_fwd_kernel and k2 is fwd.csa_fwd_kernel


@pytest.mark.parametrize("H", [8, 16, 32])
def test_few_heads_under_the_cr0_promise(monkeypatch, H):
    """At H <= 32 the cr0 promise does not pick the window kernel (64-head programs: 2.2-2.5 ms
    at Pro cr0 T = 16384 on an H100 against the few-heads forward's 0.49-0.84, heads_h100.md):
    the few-heads forward runs, on idx as given (a violated promise is computed as written,
    not poisoned), the same kernel and constants as without a promise but for the consumer
    warpgroups: one under cr0 (two were measured slower there), two without a promise at
    H <= 16."""
    from csa_jax.kernels.gluon import small_heads
    seen = []

    def fake_call(*args, kernel, out_shape, grid, num_warps, name, **consts):
        seen.append((kernel, consts, args[2].shape))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

    monkeypatch.setattr(adapter, "gluon_call", fake_call)
    monkeypatch.setattr(impl, "_check", lambda *a: None)
    monkeypatch.setattr(impl, "_amd", lambda: None)
    T, D = 64, 512
    q = jnp.zeros((1, T, H, D), jnp.bfloat16)
    kv = jnp.zeros((1, T, D), jnp.bfloat16)
    idx = np.array(_idx(T, 0))
    idx[0, 5, 0] = 40                             # token 5 breaks the promise: not an error here
    for cfg in (impl.default_config(q.shape, kv.shape, idx.shape, q.dtype, layout="cr0"),
                impl.default_config(q.shape, kv.shape, idx.shape, q.dtype)):
        o, lse = jax.jit(lambda i, c=cfg: impl.forward(q, kv, i, jnp.zeros((H,)), scale=0.1,
                                                       interpret=False, config=c))(idx)
        assert o.shape == (1, T, H, D) and lse.shape == (1, T, H)
    (k0, c0, i0), (k1, c1, i1) = seen
    assert k0 is small_heads.csa_fwd_small_heads_kernel and k1 is k0
    pair = ("CONSUMERS", "CONSUMER_REGS")
    assert c0["CONSUMERS"] == 1 and c1["CONSUMERS"] == (2 if H <= 16 else 1)
    assert {k: v for k, v in c0.items() if k not in pair} == {
        k: v for k, v in c1.items() if k not in pair}
    assert c0["H"] == H and i0 == i1 == (T, 128)


# ----------------------------------------------------------------------------- compile only


@pytest.mark.parametrize("T, NHB, G", [(4096, 2, 66), (16384, 1, 132), (16384, 2, 66)])
def test_window_kernel_compiles_without_spills(T, NHB, G):
    """12 warps (producer + two consumer warpgroups), within shared memory and its estimate, no
    spills at the shapes timed on the H200 (Pro T = 4096 / 16384, Flash T = 16384; ptxas spills
    4-100 B at some others, e.g. Flash T = 4096, 100 B: docs/gluon.md); per warpgroup the scores of its span tiles (m64n64 and the 16-row tail m64n16) and
    PV on its 256 output columns (m64n256), contiguous 16-byte cp.async."""
    if adapter.missing():
        pytest.skip(adapter.missing())
    from csa_jax.kernels.gluon import window as win
    c = adapter.compile_kernel(
        win.csa_window_kernel, win.arg_types(),
        win.constexprs(T=T, N=T, NHB=NHB, D=512, window=128, G=G, scale=512 ** -0.5),
        target="sm_90a", num_warps=win.NUM_WARPS)
    r = adapter.resources(c, "sm_90a")
    assert r["num_warps"] == 12 and r["launch_problem"] is None
    assert r["shared"] <= win.shared_bytes(512, 128) <= r["shared_limit"], r
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    ptx = c.asm["ptx"]
    for n in (64, 16, 256):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, n
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx


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