"""Context parallelism of the V4 attention layer (csa_jax/context_parallel.py, docs/context_parallel.md).

Two modes:

  time    (a GPU host, 1..8 devices): the layer's training step (forward + backward w.r.t. its
          params and x, bf16) with the sequence split over CP devices, for each overlap variant,
          against no CP on one device at the same per-device tokens and at the same T.
          CP = 1 is the layer on a mesh of one device through the CP path: it must cost what
          the plain layer costs (only the halo copy is added).

      python benchmarks/bench_cp.py time --family flash --ratio 4 --tokens 8192 --cp 1 2 4 8

  memory  (CPU, compile only): XLA's memory analysis of the same step's compiled program per
          device (arguments + outputs + temporaries - aliased), for T and CP lists; simulated
          CPU devices, so it needs no accelerator. Costs only compile time.

      python benchmarks/bench_cp.py memory --family flash --ratio 4 --T 131072 --cp 8 16 64

Both print a table and write JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=("time", "memory"))
    p.add_argument("--family", default="flash", choices=("flash", "pro"))
    p.add_argument("--ratio", type=int, nargs="+", default=[4], help="layer types (0, 4, 128)")
    p.add_argument("--cp", type=int, nargs="+", default=[1], help="context-parallel sizes")
    p.add_argument("--tokens", type=int, default=8192,
                   help="time: tokens per device (T = tokens x CP)")
    p.add_argument("--T", type=int, nargs="+", default=[131072], help="memory: sequence lengths")
    p.add_argument("--overlap", nargs="+", default=["none", "xla", "ring", "bidirectional"],
                   help="time: CP overlap variants (csa_jax.context_parallel.OVERLAPS)")
    p.add_argument("--impl", default="auto")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--small", action="store_true",
                   help="a small layer (CPU smoke run of either mode)")
    return p.parse_args(argv)


def _layer_cfg(family, ratio, impl, small, **kw):
    import dataclasses

    from csa_jax.config import CSAConfig, preset
    if small:
        return CSAConfig(ratio=ratio, num_heads=4, head_dim=64, rope_dim=32, q_rank=64,
                         o_groups=2, o_rank=64, window=32, topk=16 if ratio == 4 else 0,
                         index_heads=4, index_dim=32, d_model=64, impl=impl, **kw)
    return dataclasses.replace(preset(family, ratio), impl=impl, **kw)


def _step_fn(graphdef):
    """value_and_grad of sum(y) over (params, x): the layer's training step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def loss(state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32)) + aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _abstract_layer(cfg):
    import jax.numpy as jnp
    from flax import nnx

    from csa_jax.layers import CSAAttention
    layer = nnx.eval_shape(lambda: CSAAttention(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                rngs=nnx.Rngs(0)))
    return nnx.split(layer)


def _mesh(cp):
    import jax
    from jax.sharding import AxisType
    return jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:cp])


def memory(a):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = []
    print(f"{'layer':<12}{'T':>9}{'CP':>5}{'args GiB':>10}{'out GiB':>9}{'temp GiB':>10}"
          f"{'total GiB':>11}{'compile s':>11}")
    for ratio in a.ratio:
        for T in a.T:
            for cp in a.cp:
                cfg = _layer_cfg(a.family, ratio, a.impl, a.small,
                                 context_axis="cp" if cp > 1 else None)
                graphdef, state = _abstract_layer(cfg)
                x = jax.ShapeDtypeStruct((1, T, cfg.d_model), jnp.bfloat16)
                step = _step_fn(graphdef)
                t0 = time.perf_counter()
                try:
                    if cp > 1:
                        mesh = _mesh(cp)
                        shard = lambda s, spec: jax.ShapeDtypeStruct(  # noqa: E731
                            s.shape, s.dtype, sharding=NamedSharding(mesh, spec))
                        state_s = jax.tree.map(lambda s: shard(s, P()), state)
                        x_s = shard(x, P(None, "cp"))
                        with jax.set_mesh(mesh):
                            compiled = step.lower(state_s, x_s).compile()
                    else:
                        compiled = step.lower(state, x).compile()
                    m = compiled.memory_analysis()
                    row = dict(layer=cfg.name if not a.small else f"small-cr{ratio}", T=T, cp=cp,
                               args=m.argument_size_in_bytes, out=m.output_size_in_bytes,
                               temp=m.temp_size_in_bytes, alias=m.alias_size_in_bytes,
                               compile_s=time.perf_counter() - t0)
                    row["total"] = row["args"] + row["out"] + row["temp"] - row["alias"]
                except Exception as e:  # a row per failure, the table goes on
                    row = dict(layer=f"{a.family}-cr{ratio}", T=T, cp=cp,
                               error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                if "error" in row:
                    print(f"{row['layer']:<12}{T:>9}{cp:>5}  {row['error']}")
                else:
                    g = 2.0 ** 30
                    print(f"{row['layer']:<12}{T:>9}{cp:>5}{row['args'] / g:>10.2f}"
                          f"{row['out'] / g:>9.2f}{row['temp'] / g:>10.2f}{row['total'] / g:>11.2f}"
                          f"{row['compile_s']:>11.1f}", flush=True)
    return rows


def timing(a):
    import statistics

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from csa_jax.layers import CSAAttention

    n_dev = len(jax.devices())
    rows = []
    print(f"{jax.devices()[0].device_kind}, {n_dev} device(s)")
    print(f"{'layer':<12}{'T':>8}{'CP':>4}{'overlap':>15}{'ms':>10}{'vs no-CP same T':>17}")

    def run(cfg, T, cp, overlap):
        layer = CSAAttention(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(layer)
        x = jax.random.normal(jax.random.key(1), (1, T, cfg.d_model), jnp.bfloat16)
        step = _step_fn(graphdef)
        if cp is not None:
            mesh = _mesh(cp)
            state = jax.device_put(state, NamedSharding(mesh, P()))
            x = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
            ctx = jax.set_mesh(mesh)
        else:
            ctx = _Null()
        with ctx:
            jax.block_until_ready(step(state, x))
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                jax.block_until_ready(step(state, x))
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    for ratio in a.ratio:
        for cp in a.cp:
            if cp > n_dev:
                print(f"cr{ratio} CP={cp}: only {n_dev} device(s), skipped")
                continue
            T = a.tokens * cp
            base_cfg = _layer_cfg(a.family, ratio, a.impl, a.small)
            try:
                base = run(base_cfg, T, None, None)     # no CP: the whole sequence on one device
            except Exception as e:
                base = None
                print(f"no-CP at T={T}: {type(e).__name__}: {str(e)[:160]}")
            rows.append(dict(layer=base_cfg.name, T=T, cp=0, overlap="-", ms=base))
            print(f"{base_cfg.name:<12}{T:>8}{'-':>4}{'no CP':>15}"
                  f"{(base or float('nan')):>10.3f}{'1.00':>17}", flush=True)
            for ov in a.overlap:
                cfg = _layer_cfg(a.family, ratio, a.impl, a.small, context_axis="cp",
                                 context_overlap=ov)
                try:
                    ms = run(cfg, T, cp, ov)
                except Exception as e:
                    print(f"CP={cp} {ov}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                rows.append(dict(layer=cfg.name, T=T, cp=cp, overlap=ov, ms=ms))
                rel = f"{base / ms:.2f}x" if base else "-"
                print(f"{cfg.name:<12}{T:>8}{cp:>4}{ov:>15}{ms:>10.3f}{rel:>17}", flush=True)
    return rows


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    a = _args(argv)
    if a.mode == "memory":
        # simulated CPU devices: as many as the largest CP (set before jax is imported)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flag = f"--xla_force_host_platform_device_count={max(a.cp)}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
        rows = memory(a)
    else:
        rows = timing(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(mode=a.mode, argv=sys.argv[1:], rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
