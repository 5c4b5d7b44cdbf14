"""train/: the step, determinism, resume exactness, SIGTERM, FSDP vs one device, data order."""

from __future__ import annotations

import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

from train import loop
from train.checkpoint import Checkpointer
from train.config import ConfigError, get_preset, parse_schedule, release_schedule
from train.data import ByteDataset, DataError
from train.loop import init_state, train_and_evaluate
from train.metrics import read_metrics
from train.parallel import make_runner

# A model small enough to compile in seconds with both compressed layer types (cr0 layers are
# the window-only subset of these; tests/test_layers.py checks all three).
SMALL_MODEL = dict(d_model=32, layer_ratios=(4, 8), num_heads=2, head_dim=32, rope_dim=16,
                   q_rank=32, o_groups=2, o_rank=16, window=8, topk=4, index_heads=2,
                   index_dim=16, mlp_hidden=64)


def small_cfg(corpus, **kw):
    model = {**SMALL_MODEL, **kw.pop("model", {})}
    base = dict(data=(str(corpus),), batch_size=8, seq_len=32, lr=1e-2, warmup_steps=0,
                log_every=1, eval_every=3, eval_batches=2, ckpt_every=2, keep_checkpoints=2)
    return get_preset("tiny", model=model, **{**base, **kw})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few KB of English-like text in two files (fresh words each run would change nothing
    the tests check, so the text is fixed; the model init and data order come from seeds)."""
    d = tmp_path_factory.mktemp("corpus")
    words = ("the model reads bytes and learns which byte comes next so that common words "
             "such as these become cheap to predict while rare ones stay costly").split()
    rng = np.random.default_rng(1234)
    for i in range(2):
        text = " ".join(rng.choice(words, size=1500)) + "\n"
        (d / f"part{i}.txt").write_text(text)
    return d


def test_two_steps_fall_and_repeat(corpus, rng):
    seed = int(rng.integers(1 << 20))
    cfg = small_cfg(corpus, steps=6, seed=seed)  # the resume test's step shape: compiled once
    data = ByteDataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    graphdef, state, tx, schedule = init_state(cfg)
    runner = make_runner(cfg, graphdef, state["params"], tx, schedule)

    def two_steps(state):
        out = []
        for s in range(3):
            state, m = runner.step(state, runner.batch(data.batch(s)))
            out.append(float(m["loss"]))
        return out

    first = two_steps(runner.put(state))
    assert all(np.isfinite(first))
    assert abs(first[0] - np.log(256)) < 1.0, first  # starts near uniform over bytes
    assert first[2] < first[1] < first[0] - 0.05, first
    _, state2, _, _ = init_state(cfg)  # a fresh init with the same seed: the same numbers
    assert two_steps(runner.put(state2)) == first


def test_resume_after_sigterm_is_exact(corpus, tmp_path, monkeypatch, rng):
    seed = int(rng.integers(1 << 20))
    cfg = small_cfg(corpus, steps=6, seed=seed)
    full = train_and_evaluate(cfg, tmp_path / "a", progress=False, log=lambda s: None)
    assert full.status == "done" and sorted(full.losses) == [1, 2, 3, 4, 5, 6]

    # Run b: SIGTERM arrives during step 3; the loop saves step 3 and stops.
    real = loop.make_runner

    class SignalAtStep3:
        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def step(self, state, batch):
            out = self.runner.step(state, batch)
            if int(out[0]["step"]) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

    def make_runner_with_signal(*args):
        return SignalAtStep3(real(*args))

    monkeypatch.setattr(loop, "make_runner", make_runner_with_signal)
    part = train_and_evaluate(cfg, tmp_path / "b", progress=False, log=lambda s: None)
    assert part.status == "interrupted" and part.step == 3 and part.signal == signal.SIGTERM
    monkeypatch.setattr(loop, "make_runner", real)
    rest = train_and_evaluate(cfg, tmp_path / "b", progress=False, log=lambda s: None)
    assert rest.status == "done" and sorted(rest.losses) == [4, 5, 6]

    resumed = {**part.losses, **rest.losses}
    assert resumed == full.losses  # bitwise: same schedule, data position and state
    assert {**part.eval_losses, **rest.eval_losses} == full.eval_losses

    rows = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all({"step", "loss", "tokens_per_sec"} <= set(r) for r in rows)
    assert {r["step"]: r["loss"] for r in rows} == full.losses
    ckpts = sorted(int(p.name) for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [4, 6]  # keep_checkpoints=2
    assert (tmp_path / "b" / "loss.png").stat().st_size > 0
    assert any((tmp_path / "b" / "tb").iterdir())

    # Nothing to do once the run is complete; other settings in the same workdir are refused.
    again = train_and_evaluate(cfg, tmp_path / "b", progress=False, log=lambda s: None)
    assert again.status == "already_done"
    with pytest.raises(ConfigError, match=f"seed: saved {seed}, now {seed + 1}"):
        train_and_evaluate(dataclasses.replace(cfg, seed=seed + 1, steps=8), tmp_path / "b",
                           progress=False, log=lambda s: None)


@pytest.mark.parametrize("mode", ["xla", "explicit"])
def test_fsdp_matches_one_device(mode, corpus, tmp_path, rng):
    assert jax.device_count() == 8, "conftest simulates 8 CPU devices"
    cfg = small_cfg(corpus, model=dict(layer_ratios=(4,)), seed=int(rng.integers(1 << 20)))
    data = ByteDataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    graphdef, state, tx, schedule = init_state(cfg)
    batch = data.batch(0)

    single = make_runner(cfg, graphdef, state["params"], tx, schedule)  # cached across modes
    s1, m1 = single.step(single.put(state), single.batch(batch))

    sharded = make_runner(dataclasses.replace(cfg, fsdp=mode), graphdef, state["params"], tx, schedule)
    d = sharded.put(state)
    spread = {len(x.sharding.device_set) for x in jax.tree.leaves(d["fsdp"].params)}
    assert spread == {8}
    d, m8 = sharded.step(d, sharded.batch(batch))
    # FSDP shards the optimizer state too: each Adam moment is laid out like its param
    mu = d["fsdp"].opt_state[1][0].mu
    for p, m in zip(jax.tree.leaves(d["fsdp"].params), jax.tree.leaves(mu)):
        assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (p.shape, p.sharding, m.sharding)
    s8 = sharded.get(d)
    assert float(m8["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    assert jax.tree.structure(s8) == jax.tree.structure(s1)
    # Adam's moments carry the gradients linearly: compare them tightly.
    for a, b in zip(jax.tree.leaves(s8["opt_state"]), jax.tree.leaves(s1["opt_state"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7, rtol=1e-3)
    # Adam's first update is lr * g / (|g| + eps): ill-conditioned where |g| ~ eps, so compare
    # the new params tightly only where the gradient is clearly non-zero (and within lr elsewhere).
    mu = s1["opt_state"][1][0].mu
    for a, b, m in zip(jax.tree.leaves(s8["params"]), jax.tree.leaves(s1["params"]), jax.tree.leaves(mu)):
        a, b, big = np.asarray(a), np.asarray(b), np.abs(np.asarray(m)) > 1e-6
        np.testing.assert_allclose(a[big], b[big], atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(a, b, atol=1.01 * cfg.lr)

    # A checkpoint saved from the sharded run restores onto one device and back onto 8.
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1)
    ckpt.save(1, s8, {})
    for runner, spread in ((single, 1), (sharded, 8)):
        target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                              s8, runner.shardings(s8))
        back, _ = ckpt.restore(1, target)
        assert max(len(x.sharding.device_set) for x in jax.tree.leaves(back)) == spread
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(s8)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def test_data_order_is_deterministic_and_eval_is_held_out(corpus):
    kw = dict(seq_len=32, batch_size=4, seed=3)
    a, b = ByteDataset([str(corpus)], **kw), ByteDataset([str(corpus / "*.txt")], **kw)
    assert a.fingerprint == b.fingerprint
    for s in (0, 5, 10 * a.n_train):  # deep into a later epoch too
        np.testing.assert_array_equal(a.batch(s)[0], b.batch(s)[0])
    x, y = a.batch(1)
    assert x.shape == (4, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    # eval batches come from the held-out windows only; an epoch permutes the others
    held_out = {a._windows[i, :-1].tobytes() for i in range(a.n_train, a.n_train + a.n_eval)}
    for ex, _ in a.eval_batches(3):
        assert all(row.astype(np.uint8).tobytes() in held_out for row in ex)
    assert sorted(a._order(0).tolist()) == list(range(a.n_train))
    assert a._order(1).tolist() != a._order(0).tolist()
    assert ByteDataset([str(corpus)], **{**kw, "seed": 4}).batch(0)[0].tolist() != a.batch(0)[0].tolist()


def test_data_errors(tmp_path, corpus):
    with pytest.raises(DataError, match="nope.txt"):
        ByteDataset([str(tmp_path / "nope.txt")], seq_len=32, batch_size=2)
    (tmp_path / "small.txt").write_text("hi")
    with pytest.raises(DataError, match="too small"):
        ByteDataset([str(tmp_path / "small.txt")], seq_len=32, batch_size=2)


def test_schedules_and_config_errors():
    assert release_schedule(6, "flash") == (0, 0, 4, 128, 4, 128)
    assert release_schedule(5, "pro", 16) == (16, 16, 4, 16, 4)
    assert parse_schedule("cr0, 4,128") == (0, 4, 128)
    assert parse_schedule("flash:4", 16) == (0, 0, 4, 16)
    flash = release_schedule(43, "flash")
    assert (flash.count(0), flash.count(4), flash.count(128)) == (2, 21, 20)
    pro = release_schedule(61, "pro")
    assert (pro.count(4), pro.count(128)) == (30, 31)
    with pytest.raises(ConfigError, match="seq_len=100"):
        get_preset("tiny", seq_len=100)
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ConfigError, match="rope_dim=48 must be <= head_dim=32"):
        get_preset("tiny", model=dict(head_dim=32, rope_dim=48))
    for name in ("small", "v4-flash-layer", "v4-pro-layer"):
        get_preset(name)  # every preset is a valid config


def test_metrics_writer_without_tensorboardx(tmp_path, monkeypatch, capsys):
    import builtins
    import json

    from train.metrics import MetricsWriter

    real = builtins.__import__

    def no_tbx(name, *a, **k):
        if name == "tensorboardX":
            raise ImportError("No module named 'tensorboardX'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tbx)
    w = MetricsWriter(tmp_path, start_step=0, total_steps=2, progress=False)
    w.write({"step": 1, "loss": 2.5})
    w.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5}
    assert not (tmp_path / "tb").exists()
    assert "tensorboardX is not installed" in capsys.readouterr().err
