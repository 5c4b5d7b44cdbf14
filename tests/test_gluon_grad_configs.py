"""CPU test of benchmarks/gluon_grad_configs.py's core (the GPU check of gluon vs xla at the
grid configs): on a tiny cr4 problem, impl="xla" against itself passes, and a wrong dkv, a NaN
dq, a dkv that changes between runs and a raising impl are each reported as failures that
name the output."""
import jax.numpy as jnp
import pytest

from benchmarks import gluon_grad_configs as g
from csa_jax import problems
from csa_jax.config import CSAConfig


@pytest.fixture(scope="module")
def case():
    cfg = CSAConfig(ratio=4, num_heads=2, head_dim=16, window=8, topk=4, rope_dim=8,
                    index_heads=2, index_dim=8, o_groups=2)
    pr = problems.make_problem(cfg, 32, index_mode="random", seed=3)
    assert float(jnp.abs(pr.dlse).max()) > 0 and float(jnp.abs(pr.do).max()) > 0
    return pr, g.vjp_fn("xla", cfg.scale)


def test_self_check_passes_and_dlse_matters(case):
    pr, f = case
    row = g.check_problem(pr, f, f, name="tiny")
    assert row["ok"], row
    assert set(row["errs"]) == set(g.OUTS) and max(row["errs"].values()) == 0.0
    assert row["bit_identical"] == {"dkv": True, "dq": True}
    # the lse cotangent reaches the gradients: dropping it is a detected dq / dkv error
    no_dlse = lambda q, kv, idx, s, do, dlse: f(q, kv, idx, s, do, jnp.zeros_like(dlse))
    row = g.check_problem(pr, no_dlse, f, name="tiny")
    assert not row["ok"] and {"dq", "dkv"} <= set(row["failed"]), row


def test_wrong_results_fail_and_name_the_output(case, capsys):
    pr, f = case
    wrong = lambda *a: {**f(*a), "dkv": f(*a)["dkv"] * 1.1}
    nan_dq = lambda *a: {**f(*a), "dq": f(*a)["dq"].at[0, 5, 1, 3].set(jnp.nan)}
    rows = []
    for name, impl in (("wrong_dkv", wrong), ("nan_dq", nan_dq)):
        g.emit_row(rows, dict(g.check_problem(pr, impl, f, name=name)))
    assert rows[0]["failed"] == ["dkv"] and rows[0]["errs"]["dkv"] > 0.05
    assert rows[1]["failed"] == ["dq"]
    out = capsys.readouterr().out
    assert "# FAIL wrong_dkv: dkv" in out and "# FAIL nan_dq: dq nan" in out
    assert g.summary(rows) == 1
    assert "2 configs, 2 failed: wrong_dkv, nan_dq" in capsys.readouterr().out


def test_nondeterministic_and_raising_impls_fail(case):
    pr, f = case
    calls = []

    def flaky(*a):
        calls.append(1)
        r = f(*a)
        return {**r, "dkv": r["dkv"] + (len(calls) - 1) * 1e-3}

    row = g.check_problem(pr, flaky, f, name="flaky")
    assert row["failed"] == ["dkv not bit-identical"], row

    def boom(*a):
        raise RuntimeError("no kernel")

    row = g.check_problem(pr, f, boom, name="boom")
    assert not row["ok"] and row["failed"] == ["ref"] and "no kernel" in row["error"]


def test_cli_rejects_non_grid_configs():
    for bad in (["--configs", "pro:3:4096"], ["--configs", "pro:4"],
                ["--cr4-indices", "sorted"]):
        with pytest.raises(SystemExit):
            g.main(bad)


def test_cli_rejects_config_fields_the_impl_lacks():
    """--config refused before any row runs: a field gluon's Config does not have (a removed
    variant switch), a value it refuses, and a layout other than `auto` (the promise is the
    row's own)."""
    for bad in ("schedule=alternate", "block_k=48", "layout=cr0", "window=64"):
        with pytest.raises(SystemExit):
            g.main(["--configs", "flash:0:256", "--config", bad])


def test_layout_auto_passes_the_layers_promise(monkeypatch):
    """`--config layout=auto,...`: each row's impl gets the promise the NNX layer passes for
    its layer type and a Config built for that promise with the other overrides; the
    reference gets neither (the check itself is stubbed: this is the plumbing)."""
    import csa_jax
    seen = []
    monkeypatch.setattr(g, "vjp_fn", lambda impl, scale, config=None, layout=None:
                        seen.append((impl, config, layout)) or impl)
    monkeypatch.setattr(g, "check_problem", lambda pr, impl_fn, ref_fn, *, name: dict(
        config=name, ok=(impl_fn, ref_fn) == ("gluon", "xla"), failed=[]))
    rows = g.run([("flash", 0, 64), ("pro", 128, 256)], ["causal"], "gluon", "xla",
                 {"layout": "auto", "bwd_block_k": 16}, seed=5)
    assert [r["ok"] for r in rows] == [True, True], rows
    (i0, c0, l0), (r0, rc0, rl0), (i1, c1, l1), _ = seen
    assert (i0, i1, r0, rc0, rl0) == ("gluon", "gluon", "xla", None, None)
    assert l0 == csa_jax.Layout("cr0", window=128) and l1 == csa_jax.Layout(
        "cr128", window=128, pool_ratio=128)
    assert (c0.layout, c0.window_kernel, c0.bwd_block_k) == ("cr0", True, 16)
    assert (c1.layout, c1.window_kernel, c1.bwd_block_k) == ("cr128", False, 16)
    assert "layout='cr0'" in rows[0]["impl_config"]
