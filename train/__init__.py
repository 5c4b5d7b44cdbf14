"""train: a byte-level decoder LM with CSA / HCA / SWA attention and its training loop.

    python -m train --help

Library use: `train.get_preset("tiny")` -> TrainConfig, `train.train_and_evaluate(cfg, workdir)`.
"""

from train.config import ConfigError, ModelConfig, TrainConfig, get_preset, release_schedule

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "get_preset", "release_schedule",
           "train_and_evaluate"]


def train_and_evaluate(cfg, workdir, **kwargs):
    """See train.loop.train_and_evaluate (imported lazily: it pulls in jax, optax, orbax)."""
    from train.loop import train_and_evaluate as run

    return run(cfg, workdir, **kwargs)
