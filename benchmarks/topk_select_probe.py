"""The exact top-k select kernel's tiles and the ordering sort, alone (issue 17).

    python -m benchmarks.topk_select_probe --seq-len 8192 --out topk_select.json

On random [1, T, T/4] f32 scores with the causal -inf pattern of a cr4 layer (k = 512 as in
`small`), times (median wall-clock of jitted calls, benchmarks.common.time_fn):

    kernel_r<rows>w<warps>   csa_jax/kernels/triton/topk.py's select alone (ordered=False)
    sort_pair / sort_stable  the ordering step alone, on the kernel's (keys, ids): lax.sort on
                             (~key, id) with two keys / a stable one-key sort
    sort_unstable            an unstable one-key sort (how fast XLA's plain key-value sort is;
                             not exact where keys tie, so not a candidate as it stands)
    ordered_pair             kernel + sort_pair (what indexer_topk runs)
    lax_top_k                lax.top_k over all P rows (reference; ids checked against it)

Every ordered variant's ids are checked equal to lax_top_k's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import timed_probe
from csa_jax import blockmath
from csa_jax.kernels.triton import topk as tkt
from csa_jax.kernels.triton.config import PLATFORMS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--tiles", default="1x4,2x4,4x4,1x8,4x8", help="rows x warps of the kernel")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--time-cap", type=float, default=0.3)
    p.add_argument("--out", default="topk_select.json")
    args = p.parse_args(argv)
    T, P, k = args.seq_len, args.seq_len // 4, args.topk
    s = jax.random.normal(jax.random.key(0), (1, T, P), jnp.float32)
    vis = jnp.arange(P)[None, :] < (jnp.arange(T)[:, None] + 1) // 4
    s = jnp.where(vis[None], s, -jnp.inf)
    v, i = lax.top_k(s, k)
    ref = np.asarray(jnp.where(v > -jnp.inf, i, -1))

    def _sorter(num_keys):
        def f(ids, keys):
            if num_keys == 2:
                return lax.sort((jnp.invert(keys), ids), dimension=2, num_keys=2)[1]
            return lax.sort((jnp.invert(keys), ids), dimension=2, num_keys=1,
                            is_stable=num_keys == 1)[1]
        return jax.jit(f)

    interpret = blockmath.resolve_interpret(None, PLATFORMS)
    ids0, keys0 = tkt._select(s, k=k, rows=1, num_warps=4, interpret=interpret)
    probes = {}
    for tile in filter(None, args.tiles.split(",")):
        r, w = (int(x) for x in tile.split("x"))
        probes[f"kernel_r{r}w{w}"] = (jax.jit(lambda s, r=r, w=w: tkt.select_topk(
            s, k, rows=r, num_warps=w, ordered=False)), (s,), False)
    probes["sort_pair"] = (_sorter(2), (ids0, keys0), True)
    probes["sort_stable"] = (_sorter(1), (ids0, keys0), True)
    probes["sort_unstable"] = (_sorter(0), (ids0, keys0), True)
    probes["ordered_pair"] = (jax.jit(lambda s: tkt.select_topk(s, k)), (s,), True)
    probes["lax_top_k"] = (jax.jit(lambda s: lax.top_k(s, k)[1]), (s,), False)
    rows = []
    meta = dict(device=str(jax.devices()[0].device_kind), T=T, P=P, k=k, jax=jax.__version__)
    for name, (fn, fargs, check) in probes.items():
        row, out, _ = timed_probe(name, lambda fn=fn, fargs=fargs: (fn, fargs), args.reps,
                                  args.time_cap)
        if out is None:
            rows.append(row)
            continue
        if check:
            row["same_ids_as_lax_top_k"] = bool(np.array_equal(np.asarray(out), ref))
        rows.append(row)
        same = f" | same ids {row['same_ids_as_lax_top_k']}" if check else ""
        print(f"| {name} | {row['ms']:.3f} ms | {row['reps']} reps | first call "
              f"{row['first_s']:.1f} s{same} |", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
