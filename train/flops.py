"""Model FLOPs of one training step, by part, for model FLOP utilisation (docs/train.md).

Counted per token, as multiply-adds x 2, forward + backward:

- dense: every trained matrix (q / kv / output projections, MLP, head, the attention
  compressors' W_kv and W_gate): 2 FLOPs per weight forward, 4 backward (6 in all).
- indexer: its projections (W_q^I, W_w, its own compressor) and its scores
  2 * Hi * Di per scored pool row, forward only: top-k passes no gradient and the indexer's inputs
  are detached, so nothing runs backward unless the auxiliary indexer loss is on (then its
  projections and scores count 6 and 3 x 2 per weight / row, like trained ones).
- attention core (csa_spec.md section 3): forward 2 * H * K * 2D per token (QK^T and PV),
  backward 2.5 x forward, with K slots per token counted two ways:
    nominal: the convention everybody reports, K = window + min(topk, P) (cr4), window + P (HCA),
             window (cr0);
    valid:   the slots a token can see, averaged over the sequence: min(t + 1, window) window
             rows, min(topk, (t + 1) // 4) (cr4) or (t + 1) // m (HCA) pool rows. At T = 8192
             this is ~6% below nominal for cr4 and ~50% below for the pool part of HCA.
  The indexer's scores are counted the same two ways (all P rows / the visible ones).

Not counted: norms, RoPE, softmax and other elementwise work, the embedding gather.
"""

from __future__ import annotations

import numpy as np

__all__ = ["step_flops"]


def _mean_visible(T, ratio, cap=None):
    t = np.arange(T)
    vis = (t + 1) // ratio
    if cap is not None:
        vis = np.minimum(vis, cap)
    return float(vis.mean())


def step_flops(model, seq_len: int) -> dict:
    """FLOPs per token of a training step of `model` (a train.config.ModelConfig) at seq_len.

    Returns {"dense", "indexer_proj", "indexer_scores_nominal", "indexer_scores_valid",
    "attention_nominal", "attention_valid", "nominal", "valid"}; nominal / valid are the totals
    with the attention core and indexer scores at nominal / valid slots.
    """
    a = model.attention  # the base per-layer csa_jax.CSAConfig
    C, H, D, G = a.d_model, a.num_heads, a.head_dim, a.o_groups
    Hi, Di = a.index_heads, a.index_dim
    T = seq_len
    aux = a.indexer_loss_coef > 0
    window_valid = float(np.minimum(np.arange(T) + 1, a.window).mean())
    dense = idx_proj = idx_nom = idx_val = att_nom = att_val = 0.0
    for r in model.layer_ratios:
        w = C * a.q_rank + a.q_rank * H * D + C * D          # wq_a, wq_b, wkv
        w += H * D * a.o_rank + G * a.o_rank * C             # wo_a (grouped), wo_b
        w += 3 * C * model.mlp_hidden                                # SwiGLU
        k_nom, k_val = a.window, window_valid
        if r > 0:
            coff = 2 if r == 4 else 1
            w += 2 * C * coff * D                                    # compressor W_kv, W_gate
            P = T // r
            if r == 4:
                k_nom += min(a.topk, P)
                k_val += _mean_visible(T, r, a.topk)
            else:
                k_nom += P
                k_val += _mean_visible(T, r)
        dense += 6.0 * w
        if r == 4:
            wi = a.q_rank * Hi * Di + C * Hi + 2 * C * 2 * Di    # W_q^I, W_w, its compressor
            idx_proj += (6.0 if aux else 2.0) * wi
            per_row = 2.0 * Hi * Di * (3.0 if aux else 1.0)
            idx_nom += per_row * (T // r)
            idx_val += per_row * _mean_visible(T, r)
        att_nom += 2.0 * H * k_nom * 2 * D * 3.5                     # forward + 2.5 x backward
        att_val += 2.0 * H * k_val * 2 * D * 3.5
    dense += 6.0 * C * model.vocab_size                              # head
    return {"dense": dense, "indexer_proj": idx_proj, "indexer_scores_nominal": idx_nom,
            "indexer_scores_valid": idx_val, "attention_nominal": att_nom,
            "attention_valid": att_val, "nominal": dense + idx_proj + idx_nom + att_nom,
            "valid": dense + idx_proj + idx_val + att_val}
