"""Writes tests/data/nnx_reference.npz: what the NNX layer and the decoder LM computed before
they took Flax's conventions (dtype / param_dtype, kernel_init, nnx.RMSNorm, partition
metadata). Run once on the layout before them (arch eaf1c3c + this branch), with
`PYTHONPATH=. python tests/_make_nnx_reference.py`; tests/test_nnx_conventions.py checks that
the current code still gives these numbers. Not a test itself.

Stored per case: a sha256 of every initial parameter (the init must be unchanged bit for bit),
and the output for fixed inputs with randomized parameters (tests/test_layers.make_layer).
"""

import hashlib
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

LAYER_RATIOS = (0, 4, 8)
MODEL = dict(d_model=32, layer_ratios=(0, 4, 8), num_heads=2, head_dim=32, rope_dim=16,
             q_rank=32, o_groups=2, o_rank=16, window=8, topk=4, index_heads=2, index_dim=16,
             mlp_hidden=64)


def param_hashes(module) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)))[0]
    return {jax.tree_util.keystr(p): hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
            for p, v in flat}


def layer_input(ratio):
    return jax.random.normal(jax.random.key(100 + ratio), (2, 16, 32), jnp.float32)


def model_tokens():
    return jax.random.randint(jax.random.key(7), (2, 16), 0, 256)


def main():
    from test_layers import make_layer, small_cfg

    from csa_jax.layers import CSAAttention
    from train.config import ModelConfig
    from train.model import DecoderLM

    out = {}
    for r in LAYER_RATIOS:
        cfg = small_cfg(r)
        for k, v in param_hashes(CSAAttention(cfg, rngs=nnx.Rngs(3))).items():
            out[f"cr{r}/hash/{k}"] = np.asarray(v)
        y, aux = make_layer(cfg, 3)(layer_input(r))
        out[f"cr{r}/y"] = np.asarray(y)
    model = DecoderLM(ModelConfig().replace(**MODEL), rngs=nnx.Rngs(params=5))
    for k, v in param_hashes(model).items():
        out[f"lm/hash/{k}"] = np.asarray(v)
    logits, _ = model(model_tokens())
    out["lm/logits"] = np.asarray(logits)
    path = os.path.join(os.path.dirname(__file__), "data", "nnx_reference.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path}: {len(out)} arrays")


if __name__ == "__main__":
    main()
